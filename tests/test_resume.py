"""Resume: the run store's file handling, and `mlight run` killed at random points (kill -9, SIGINT,
SIGTERM) in a subprocess, rerun until done — every request ends up in the output exactly once."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.errors import MlightError, UsageError
from core.io.runstore import RunStore

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = {"model": {"source": "m", "config_sha256": "c"}, "prompts": {"sha256": "p"}, "settings": {"t": 0},
            "policy": {"batch": 4}}


def rec(i) -> dict:
    return {"id": str(i), "prompt": f"p{i}", "output": "o", "output_token_ids": [1], "prompt_tokens": 1,
            "output_tokens": 1, "finish_reason": "length", "seconds": 0.1}


def test_a_model_is_identified_by_its_config_and_its_weight_files_sizes(tmp_path):
    """The manifest's model section, which a resume must match: config.json's sha256 and the size of each
    weight file (safetensors, their index, GGUF); other files do not count."""
    import hashlib

    from core.io.runstore import model_fingerprint

    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_bytes(b'{"layers": 2}')
    (m / "model-00001-of-00002.safetensors").write_bytes(b"w" * 10)
    (m / "model.safetensors.index.json").write_bytes(b"{}")
    (m / "model-q4.gguf").write_bytes(b"g" * 7)
    (m / "tokenizer.json").write_bytes(b"{}")
    (m / "README.md").write_bytes(b"# not weights")
    fp = model_fingerprint(m)
    assert fp == {"source": str(m), "config_sha256": hashlib.sha256(b'{"layers": 2}').hexdigest(),
                  "weights": {"model-00001-of-00002.safetensors": 10, "model.safetensors.index.json": 2,
                              "model-q4.gguf": 7}}
    assert model_fingerprint(m, source="org/name")["source"] == "org/name"
    try:  # a weight file that cannot be read (a dangling link) is named, with no size
        (m / "gone.safetensors").symlink_to(m / "nowhere.safetensors")
    except OSError:
        return  # Windows without the right to make links
    assert model_fingerprint(m)["weights"]["gone.safetensors"] is None


# ------------------------------------------------------------------------------------------------
# run store


def test_fresh_run_append_finish(tmp_path):
    out = tmp_path / "o.jsonl"
    with RunStore(out) as st:
        st.start(MANIFEST)
        st.append(rec(1))
        st.append(rec(2))
        lines = st.run_path.read_text().splitlines()
        assert json.loads(lines[0])["mlight_run"] == 1 and len(lines) == 3
        st.finish([st.done["1"], st.done["2"]])
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["1", "2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl"]  # run file and lock file gone


def test_resume_cuts_torn_line_and_dedupes(tmp_path):
    out = tmp_path / "o.jsonl"
    with RunStore(out) as st:
        st.start(MANIFEST)
        st.append(rec(1))
        st.append(rec(2))
    with open(out.with_name("o.jsonl.run.jsonl"), "ab") as f:  # a crash mid-write, after a duplicate
        f.write(json.dumps(rec(1)).encode() + b"\n" + b'{"id": "3", "prom')
    with RunStore(out) as st:
        st.start(MANIFEST)
        assert st.resumed and sorted(st.done) == ["1", "2"]
        st.append(rec(3))
        assert st.run_path.read_bytes().endswith(b"\n")
        assert [json.loads(x).get("id") for x in st.run_path.read_text().splitlines()[1:]] == ["1", "2", "1", "3"]


def test_changed_prompts_or_model_refused_unless_restart(tmp_path):
    out = tmp_path / "o.jsonl"
    with RunStore(out) as st:
        st.start(MANIFEST)
        st.append(rec(1))
    for key, label in (("prompts", "another prompts file"), ("model", "another model"),
                       ("settings", "other generation settings")):
        changed = {**MANIFEST, key: {"other": True}}
        with RunStore(out) as st, pytest.raises(UsageError, match=f"made with {label} — .*--restart"):
            st.start(changed)
    with RunStore(out) as st:  # the policy may change between tries
        st.start({**MANIFEST, "policy": {"batch": 64}})
        assert st.resumed and list(st.done) == ["1"]
    with RunStore(out) as st:
        st.start({**MANIFEST, "prompts": {"sha256": "new"}}, restart=True)
        assert not st.resumed and st.done == {}


def test_unreadable_run_file_is_not_discarded_silently(tmp_path):
    out = tmp_path / "o.jsonl"
    out.with_name("o.jsonl.run.jsonl").write_text('{"id": "1"}\n')
    with RunStore(out) as st, pytest.raises(UsageError, match="is not a run file mlight can read"):
        st.start(MANIFEST)
    with RunStore(out) as st:
        st.start(MANIFEST, restart=True)
        assert st.done == {}


def test_existing_output_needs_restart_and_survives_until_finish(tmp_path):
    out = tmp_path / "o.csv"
    out.write_text("precious\n")
    with RunStore(out) as st, pytest.raises(UsageError, match="already exists — pass --restart"):
        st.start(MANIFEST)
    with RunStore(out) as st:
        st.start(MANIFEST, restart=True)
        assert out.read_text() == "precious\n"  # replaced only by a finished run
        st.append(rec(1))
        st.finish([rec(1)])
    assert out.read_text().startswith("id,prompt,output")


def test_second_run_on_same_output_refuses(tmp_path):
    out = tmp_path / "o.jsonl"
    with RunStore(out), pytest.raises(MlightError, match="another mlight run is writing .*o.jsonl"):
        RunStore(out).acquire()
    with RunStore(out):  # free again once the first is done
        pass


def test_disk_full_on_append_leaves_clean_run_file(tmp_path):
    out = tmp_path / "o.jsonl"

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            self.f.write(b[:5])  # a partial write, then the disk is full
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    with RunStore(out) as st:
        st.start(MANIFEST)
        st.append(rec(1))
        st._file = Full(st._file)
        with pytest.raises(MlightError, match=r"disk full while writing .*run.jsonl \(1 finished result kept\)"):
            st.append(rec(2))
        st._file = st._file.f
        st.close()
        assert st.run_path.read_bytes().endswith(b"\n") and len(st.run_path.read_text().splitlines()) == 2


# ------------------------------------------------------------------------------------------------
# killed at random points, in a subprocess


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.pop("HF_HUB_OFFLINE", None)
    return env


def _cmd(prompts: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", "run", "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "8", "--batch", "1", *extra]


def _results_in(run_file: Path) -> int:
    try:
        return max(0, run_file.read_bytes().count(b"\n") - 1)
    except OSError:
        return 0


def _start_and_wait(cmd, run_file: Path, target: int, timeout: float = 120.0) -> subprocess.Popen:
    """Start the run; return once the run file holds `target` results (or the run has ended)."""
    proc = subprocess.Popen(cmd, cwd=run_file.parent, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and _results_in(run_file) < target:
        assert time.monotonic() < deadline, "run did not progress"
        time.sleep(0.002)
    return proc


@pytest.fixture(scope="module")
def many_prompts(tmp_path_factory, demo_model) -> Path:
    d = tmp_path_factory.mktemp("resume data")
    p = d / "prompts.txt"
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]
    rng = random.Random(0)
    p.write_text("\n".join(" ".join(rng.choices(words, k=rng.randint(1, 12))) for _ in range(12)) + "\n")
    return p


@pytest.fixture(scope="module")
def reference(many_prompts, tmp_path_factory) -> dict:
    """Outputs of an uninterrupted run (in-process)."""
    from app.cli import main

    out = tmp_path_factory.mktemp("ref") / "ref.jsonl"
    assert main(["run", "--prompts", str(many_prompts), "--out", str(out), "--max-new-tokens", "8",
                 "--batch", "1"]) == 0
    return {r["id"]: r["output_token_ids"] for r in map(json.loads, out.read_text().splitlines())}


def _check_final(out: Path, reference: dict) -> None:
    rows = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in rows] == list(reference)  # each exactly once, in input order
    assert {r["id"]: r["output_token_ids"] for r in rows} == reference
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(out.name)) == [out.name]


@pytest.mark.slow
def test_kill_9_at_random_points_then_resume(many_prompts, reference, tmp_path):
    rng = random.Random(int(os.environ.get("MLIGHT_TEST_SEED", "1234")))
    out = tmp_path / "résultats finaux.jsonl"  # a space and non-ASCII on purpose
    run_file = out.with_name(out.name + ".run.jsonl")
    cmd = _cmd(many_prompts, out)
    n = len(reference)
    kills = 0
    for _ in range(3):
        target = rng.randint(_results_in(run_file), n - 1)
        proc = _start_and_wait(cmd, run_file, target)
        if proc.poll() is None:
            proc.kill()  # SIGKILL: no cleanup of any kind
            kills += 1
        proc.communicate(timeout=60)
        assert not out.exists() or proc.returncode == 0
    assert kills >= 2
    _finish_in_process(cmd)
    _check_final(out, reference)


def _finish_in_process(cmd: list[str]) -> str:
    """The rerun that completes the job (in this process: the state that matters is on disk)."""
    import contextlib
    import io

    from app.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(cmd[3:]) == 0, err.getvalue()
    return err.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_signal_finishes_step_saves_and_exits_130(many_prompts, reference, tmp_path, sig):
    if not hasattr(signal, sig) or os.name == "nt":
        pytest.skip("POSIX signals")
    out = tmp_path / "o.jsonl"
    run_file = out.with_name("o.jsonl.run.jsonl")
    proc = _start_and_wait(_cmd(many_prompts, out), run_file, 3)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=60)
    err = err.decode()
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal arrived")
    assert proc.returncode == 130, err
    saved = _results_in(run_file)
    assert f"mlight run: interrupted: {saved} of {len(reference)} requests done, saved in o.jsonl.run.jsonl; " \
           "rerun the same command to finish the rest" in err
    assert err.strip().count("\n") == 0 and not out.exists() and saved >= 3
    again = _finish_in_process(_cmd(many_prompts, out))
    assert f"resuming: {saved} of {len(reference)} requests already done by an earlier run" in again
    _check_final(out, reference)


class _FakeEngine:
    """Yields one result per request, checking should_stop before each (as the engine does per step)."""

    context_length = 100

    def __init__(self):
        self.calls = []

    def prompt_token_ids(self, req):
        return [0] * len(req.prompt)

    def generate(self, requests, *, batch_size=None, micro_batch_size=None, on_event=None, should_stop=None):
        from core.runtime.engine import Result

        self.calls.append([r.id for r in requests])
        for r in requests:
            if should_stop and should_stop():
                return
            yield Result(r.id, r.prompt, "out", [5], len(r.prompt), 1, "length", 0.0)


def test_run_pending_stops_and_resumes_with_the_shared_loop(tmp_path):
    from core.io.prompts import read_prompts
    from core.io.runstore import finish_run, prepare_requests, run_pending

    prompts = read_prompts("p.txt", data=b"a\nbb\n" + b"x" * 150 + b"\nccc\n")
    engine, out = _FakeEngine(), tmp_path / "o.jsonl"
    with RunStore(out) as st:
        st.start(MANIFEST)
        reqs = prepare_requests(engine, prompts, {"max_new_tokens": 4})
        assert [r.line for r in prompts.rejects] == [3]  # 150 tokens > the context of 100
        seen = []
        assert not run_pending(engine, prompts, st, reqs, should_stop=lambda: len(seen) >= 2, on_result=seen.append)
    with RunStore(out) as st:
        st.start(MANIFEST)
        reqs = prepare_requests(engine, prompts, {"max_new_tokens": 4})
        assert run_pending(engine, prompts, st, reqs)
        assert engine.calls[-1] == ["4"]  # only what was missing
        records = finish_run(st, prompts, "m")
    assert [r["id"] for r in records] == ["1", "2", "4"]
    assert [json.loads(x)["id"] for x in out.with_name("o.jsonl.rejected.jsonl").read_text().splitlines()] == ["3"]


def test_a_run_file_of_another_job_is_refused_in_plain_words(tmp_path):
    out = tmp_path / "o.jsonl"
    with RunStore(out) as st:
        st.start(MANIFEST)
        st.append(rec(1))
    for changed, says in (({"settings": {"t": 1}}, "made with other generation settings"),
                          ({"model": {"source": "n"}, "settings": {"t": 1}},
                           "made with another model and other generation settings"),
                          ({"prompts": {"sha256": "q"}}, "made with another prompts file")):
        with RunStore(out) as st, pytest.raises(UsageError) as e:
            st.start({**MANIFEST, **changed})
        assert e.value.problem == f"o.jsonl.run.jsonl holds an unfinished run (1 result) {says}"


def test_resuming_says_what_this_run_did_and_what_an_earlier_one_did(tmp_path, capsys, monkeypatch, demo_model):
    """Stopped before any result, then after two: the next run says what was done before, and its last
    line counts this run's results and new tokens (never an earlier session's) with thousands separators."""
    import app.commands.run as run_cmd
    from app.cli import main

    prompts, out = tmp_path / "p.txt", tmp_path / "o.jsonl"
    prompts.write_text("one\ntwo\nthree\n", encoding="utf-8")
    cmd = ["run", "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "4", "--batch", "1"]
    real = run_cmd.run_pending

    def stopped_after(n):
        def fake(*a, on_result, should_stop, **kw):
            seen = []
            return real(*a, **kw, on_result=lambda r: (seen.append(r), on_result(r)),
                        should_stop=lambda: len(seen) >= n)
        return fake

    monkeypatch.setattr(run_cmd, "run_pending", stopped_after(0))
    assert main(cmd) == 130
    capsys.readouterr()
    monkeypatch.setattr(run_cmd, "run_pending", stopped_after(2))
    assert main(cmd) == 130
    assert "mlight run: resuming: the earlier run on this output finished none of the 3 requests; running them " \
           "all\n" in capsys.readouterr().err
    first = {r["id"] for r in _records_in(out.with_name("o.jsonl.run.jsonl"))}
    monkeypatch.setattr(run_cmd, "run_pending", real)
    assert main(cmd) == 0
    err = capsys.readouterr().err
    assert "mlight run: resuming: 2 of 3 requests already done by an earlier run; running the other 1\n" in err
    new = [r for r in map(json.loads, out.read_text().splitlines()) if r["id"] not in first]
    assert len(first) == 2 and len(new) == 1
    assert f"results in {out} (this run: 1 generated, {new[0]['output_tokens']} new tokens, " in err
    line = run_cmd.final_line(12345, RunStore(out), 1200, 4321, 1234567, 2.0)
    assert line == f"12,345 results in {out}, 1,200 rejected → o.jsonl.rejected.jsonl (this run: 4,321 generated, " \
                   "1,234,567 new tokens, 2.0 s)"


def _records_in(run_file: Path) -> list[dict]:
    return [json.loads(x) for x in run_file.read_text().splitlines()[1:]]
