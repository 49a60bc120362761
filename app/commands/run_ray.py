"""`mlight run --ray ADDRESS|auto`: the prompts not yet done mapped through Ray Data's actor pool, one engine
replica per actor (per GPU, or per node on a CPU cluster); results saved as they stream back, so a stop resumes."""

from __future__ import annotations

import time
from pathlib import Path

from app.commands.run import (_Counter, _say, check_files, end_run, refuse_turns, resuming_line, sampling, with_run,
                              workload_estimate)
from core.errors import MlightError, UsageError
from core.io.runstore import RunStore


def _ray():
    try:
        import ray
        import ray.data  # noqa: F401 - the Data library is part of the extra
    except ImportError:
        raise UsageError("--ray needs Ray Data, which is not installed",
                         'install the extra: pip install "mlight[ray]"') from None
    return ray


def _connect(ray, address: str) -> None:
    if ray.is_initialized():  # a driver that started Ray itself (tests, notebooks) keeps its instance
        return
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise MlightError(f"cannot reach the Ray cluster at {address!r}: {str(e).splitlines()[0]}",
                          "start one (`ray start --head`) or give its address, e.g. --ray ray://head:10001") from e


def _actors(ray, wanted: int | None) -> tuple[int, float, float]:
    res = ray.cluster_resources()
    gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 1))
    nodes = max(1, sum(1 for n in ray.nodes() if n.get("Alive")))
    if gpus:
        n = wanted or gpus
        return n, max(1.0, (cpus // n) or 1), max(1.0, gpus // n) if n <= gpus else gpus / n
    n = wanted or nodes
    return n, max(1, cpus // n), 0.0


def run(args) -> int:
    ray = _ray()
    out = Path(args.out)
    fmt = check_files(args, out, ("--ray reads the prompts from a file", "give --prompts FILE"), micro=False)
    if args.tensor_parallel > 1:
        raise UsageError("--ray runs one engine per actor; --tensor-parallel is for torchrun or one machine",
                         "drop --tensor-parallel, or use torchrun for tensor-parallel replicas")

    def plan(args, prompts, model_dir) -> None:
        refuse_turns(prompts, "--ray")
        args.policy = None  # each actor plans for the node it lands on

    return with_run(args, out, plan, lambda store, prompts, model_dir, model_name, progress, stopper: _generate(
        ray, args, store, prompts, model_dir, model_name, fmt, stopper))


def _rows(entries, defaults) -> list[dict]:
    rows = [e.request_kwargs(defaults) for e in entries]  # `messages` there are fresh dicts already
    for kw in rows:
        kw["stop"] = list(kw.get("stop") or ())
    return rows


def _generate(ray, args, store: RunStore, prompts, model_dir: Path, model_name: str, fmt: str, stopper) -> int:
    from core.runtime.distributed.ray_data import MlightPredictor, plan_here

    defaults = sampling(args)
    pending = [e for e in prompts.entries if e.id not in store.done]
    total, before, t0 = len(prompts.entries), len(store.done), time.perf_counter()
    if store.resumed:
        _say(resuming_line(before, total))
    if pending:
        _connect(ray, args.ray)
        actors, cpus, gpus = _actors(ray, args.ray_actors)
        # plan where the engines run, for the actors sharing a node (here, on a one-node cluster: no extra worker)
        alive = [n for n in ray.nodes() if n.get("Alive")]
        share = max(1, actors // max(1, len(alive)))
        plan_args = (str(model_dir), workload_estimate(args, pending), share, args.gpu_mem, args.cpu_mem)
        if len(alive) == 1 and alive[0].get("NodeManagerAddress") == ray.util.get_node_ip_address():
            policy = plan_here(*plan_args)
        else:
            policy = ray.get(ray.remote(num_cpus=0.01, num_gpus=gpus)(plan_here).remote(*plan_args))
        batch = args.batch or policy["batch_size"]
        _say(f"Ray: {actors} actor{'s' if actors > 1 else ''} ({cpus:g} CPU{'s' if cpus != 1 else ''}"
             + (f", {gpus:g} GPU" if gpus else "") + f" each), batches of {batch}")
        ds = ray.data.from_items(_rows(pending, defaults))
        mapped = ds.map_batches(MlightPredictor, batch_format="pandas", batch_size=batch, concurrency=actors,
                                num_cpus=cpus, num_gpus=gpus or None,
                                fn_constructor_kwargs={"model": str(model_dir), "policy": policy, "defaults": defaults,
                                                       "threads": int(cpus), "executor": args.executor,
                                                       "schedule": args.schedule, "dtype": args.dtype})
        counter = _Counter(total)
        stopper.generating = True
        try:
            for df in mapped.iter_batches(batch_format="pandas", batch_size=None):
                for rec in df.to_dict("records"):
                    rec = _record(rec)
                    store.append(rec)
                    counter(rec)
                if stopper.requested:
                    break
        except KeyboardInterrupt:
            pass
        finally:
            stopper.generating = False
            counter.end()
    done = sum(1 for e in prompts.entries if e.id in store.done)
    return end_run(store, prompts, model_name, fmt, done == total, before, counter.tokens if pending else 0, t0,
                   " on Ray")


def _record(rec: dict) -> dict:
    """A result row from Ray as the plain record a single-process run writes."""
    from core.runtime.distributed.ray_data import _plain

    out = {k: _plain(v) for k, v in rec.items()}
    for k in ("prompt_tokens", "output_tokens"):
        out[k] = int(out[k])
    out["output_token_ids"] = [int(t) for t in out["output_token_ids"]]
    out["seconds"] = float(out["seconds"])
    return out

