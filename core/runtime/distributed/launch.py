"""Local ranks through torch's elastic launcher, never restarted: a failed run resumes when the command runs again."""

from __future__ import annotations

import logging
import uuid

from core.errors import MlightError


def launch_local(nprocs: int, command: list[str]) -> int:
    """Run `command` (argv) as `nprocs` ranks: 0 when every rank exits 0, else rank 0's code (or a failure's)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=f"mlight-{uuid.uuid4().hex[:12]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1)
    quiet = logging.getLogger("torch.distributed.elastic")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # the ranks report their own errors; the agent's log repeats them
    try:
        elastic_launch(config, command[0])(*command[1:])
        return 0
    except ChildFailedError as e:
        failures = e.failures  # global rank -> ProcessFailure
        zero = failures.get(0)
        if zero is not None and zero.exitcode > 0:
            return zero.exitcode  # rank 0 reported the job's outcome itself
        first = zero or failures[min(failures)]
        how = f"signal {-first.exitcode}" if first.exitcode < 0 else f"exit code {first.exitcode}"
        raise MlightError(f"rank {first.rank} of {nprocs} died ({how}) before the end of the run",
                          "finished results are saved; rerun the same command to resume") from None
    except SignalException:
        return 130
    finally:
        quiet.setLevel(level)
