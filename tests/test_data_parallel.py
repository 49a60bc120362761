"""Several ranks end to end, through the real launchers: `torchrun` (data parallel: the prompts sharded
over ranks, one run file each, rank 0 merging) and `mlight run --tensor-parallel 2` (torch's elastic
launcher started by mlight). Each must write exactly the output of one process; a rank killed mid-run,
then a rerun, must lose and duplicate nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from app.cli import main

pytestmark = pytest.mark.slow

PROMPTS = [f"Prompt number {i}: tell me about {w}" for i, w in enumerate(
    ["dragons", "the sea", "France", "a cat", "rain", "trains", "the moon", "bread", "music"])]


def _records(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    for r in rows:
        r.pop("seconds")  # wall time differs between runs; every other field must not
    return rows


@pytest.fixture(scope="module")
def job(tmp_path_factory, demo_model):
    """The prompts file and the one-process output every parallel run must reproduce."""
    d = tmp_path_factory.mktemp("dp")
    prompts = d / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    args = ["--model", str(demo_model), "--prompts", str(prompts), "--max-new-tokens", "16", "--batch", "2"]
    assert main(["run", *args, "--out", str(d / "single.jsonl")]) == 0
    return d, args, _records(d / "single.jsonl")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return env


def _torchrun(args: list[str], nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "app.cli", "run", *args]


def _rank_pid(launcher: psutil.Process, rank: int) -> int | None:
    for child in launcher.children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "app.cli" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None


def _results_in(path: Path) -> int:
    try:
        return max(0, len(path.read_text(encoding="utf-8").splitlines()) - 1)  # after the manifest
    except OSError:
        return 0


def test_a_killed_rank_is_named_and_a_rerun_resumes_every_rank(job):
    """Two data-parallel ranks under torchrun; rank 1 is killed mid-shard. The job fails naming it,
    every finished result is kept, and the same command again writes exactly the one-process output."""
    d, args, want = job
    out = d / "killed.jsonl"
    slow = [*args[:-1], "1", "--out", str(out)]  # one request at a time: rank 1 is mid-shard when killed
    proc = subprocess.Popen(_torchrun(slow), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    part1 = d / "killed.jsonl.dp1of2.run.jsonl"
    deadline = time.monotonic() + 180
    while _results_in(part1) < 1 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    pid = _rank_pid(psutil.Process(proc.pid), 1)
    assert pid is not None and _results_in(part1) >= 1, "rank 1 never saved a result"
    os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert "rank 1" in err and "stopped before the end" in err, err
    assert not out.exists()
    kept = _results_in(part1)
    assert 1 <= kept < len(PROMPTS) // 2  # the rank died mid-shard, its finished results kept

    again = subprocess.run(_torchrun(slow), env=_env(), capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr
    assert "resuming:" in again.stderr and "2 replicas" in again.stderr
    assert _records(out) == want  # the one-process output: nothing lost, nothing twice, input order
    assert sorted(f.name for f in d.iterdir() if f.name.startswith("killed.jsonl")) == ["killed.jsonl"]  # merged


def test_tensor_parallel_run_resumes_a_one_process_run(job):
    """`mlight run --tensor-parallel 2` starts two gloo ranks itself, picks up the run file a killed
    one-process run left, and writes the same output as one process."""
    d, args, want = job
    out = d / "tp.jsonl"
    slow = [*args[:-1], "1", "--out", str(out)]
    first = subprocess.Popen([sys.executable, "-m", "app.cli", "run", *slow], env=_env(), stderr=subprocess.PIPE)
    run_file = d / "tp.jsonl.run.jsonl"
    deadline = time.monotonic() + 120
    while _results_in(run_file) < 2 and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.02)
    first.kill()
    first.communicate(timeout=60)
    kept = _results_in(run_file)
    assert 2 <= kept < len(PROMPTS)
    p = subprocess.run([sys.executable, "-m", "app.cli", "run", *slow, "--tensor-parallel", "2"], env=_env(),
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    assert f"resuming: {kept} of {len(PROMPTS)}" in p.stderr and "2 ranks" in p.stderr
    assert _records(out) == want
    assert not run_file.exists()
