"""The experts' form chosen by timing (core.model.expert_choice), kept on disk per machine for the CPU.

What is asserted, with candidates that count their calls and a clock that makes one of them faster:
- a process times a CPU shape once, and a later process (this one with its memory of choices cleared) reads the
  choice back without running either candidate;
- a choice holds only where it was made: another thread count, ISA limit in the environment or cache folder times
  again; a GPU's shape is timed in every process;
- a torn or foreign file is measured over, not trusted; a cache that cannot be written still yields the choice.
And end to end: the engine's first prefill in a second process runs the experts once a layer, not eight times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.model import expert_choice

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache folder and a process that remembers no choice."""
    monkeypatch.setenv("MLIGHT_CACHE_DIR", str(tmp_path / "cache dir ü"))
    monkeypatch.setattr(expert_choice, "_CHOICE", {})
    monkeypatch.setattr(expert_choice, "_saved", {})
    return tmp_path / "cache dir ü"


def new_process(monkeypatch):
    monkeypatch.setattr(expert_choice, "_CHOICE", {})
    monkeypatch.setattr(expert_choice, "_saved", {})


class Counting:
    """Candidates whose calls are counted; `slow` advances the fake clock by more than the other."""

    def __init__(self, slow: str = "grouped"):
        self.now, self.calls, self.slow = 0.0, {"grouped": 0, "loop": 0}, slow

    def clock(self) -> float:
        return self.now

    def candidates(self) -> dict:
        def run(name):
            def fn():
                self.calls[name] += 1
                self.now += 2.0 if name == self.slow else 1.0
            return fn
        return {name: run(name) for name in self.calls}


KEY = ("cpu", torch.float32, 8, 512, 128, 128, False, True, 2048)


def choose(c: Counting, key=KEY) -> str:
    return expert_choice.choose(key, c.candidates(), clock=c.clock)


def test_a_cpu_choice_is_timed_once_per_machine_and_read_back_by_later_processes(fresh, monkeypatch):
    first = Counting(slow="grouped")
    assert choose(first) == "loop"
    assert first.calls == {"grouped": 1 + expert_choice.TRIALS, "loop": 1 + expert_choice.TRIALS}
    again = Counting(slow="grouped")
    assert choose(again) == "loop" and again.calls == {"grouped": 0, "loop": 0}  # same process: remembered
    new_process(monkeypatch)
    later = Counting(slow="loop")  # were it timed, it would now pick grouped
    assert choose(later) == "loop" and later.calls == {"grouped": 0, "loop": 0}
    files = list((fresh / "expert_choice").glob("*.json"))
    assert len(files) == 1 and "loop" in json.loads(files[0].read_text(encoding="utf-8")).values()


@pytest.mark.parametrize("change", ["threads", "isa limit", "cache folder"])
def test_a_choice_holds_only_where_it_was_made(fresh, monkeypatch, tmp_path, change):
    choose(Counting(slow="grouped"))
    new_process(monkeypatch)
    threads = torch.get_num_threads()
    if change == "threads":
        torch.set_num_threads(threads + 1)
    elif change == "isa limit":
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2" if os.environ.get("ONEDNN_MAX_CPU_ISA") != "AVX2" else "SSE41")
    else:
        monkeypatch.setenv("MLIGHT_CACHE_DIR", str(tmp_path / "another"))
    try:
        c = Counting(slow="loop")
        assert choose(c) == "grouped" and c.calls["grouped"] == 1 + expert_choice.TRIALS
    finally:
        torch.set_num_threads(threads)


def test_a_gpu_choice_is_timed_in_every_process(fresh, monkeypatch):
    key = ("cuda", *KEY[1:])
    choose(Counting(slow="grouped"), key)
    new_process(monkeypatch)
    c = Counting(slow="loop")
    assert choose(c, key) == "grouped" and c.calls["loop"] == 1 + expert_choice.TRIALS
    assert not (fresh / "expert_choice").exists()


@pytest.mark.parametrize("text", ["{\"torn", "[1, 2]", "{\"2|x\": 3}", "\ufeffnot json"])
def test_a_torn_or_foreign_file_is_measured_over(fresh, monkeypatch, text):
    choose(Counting())
    (path,) = (fresh / "expert_choice").glob("*.json")
    path.write_text(text, encoding="utf-8")
    new_process(monkeypatch)
    c = Counting(slow="loop")
    assert choose(c) == "grouped" and c.calls["loop"] == 1 + expert_choice.TRIALS
    assert "grouped" in json.loads(path.read_text(encoding="utf-8")).values()  # written anew


def test_a_cache_that_cannot_be_written_still_yields_the_choice(fresh, monkeypatch, tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder", encoding="utf-8")
    monkeypatch.setenv("MLIGHT_CACHE_DIR", str(blocker))  # its expert_choice folder cannot be made
    c = Counting(slow="grouped")
    assert choose(c) == "loop"
    assert blocker.read_text(encoding="utf-8") == "not a folder"


CHILD = r"""
import json, sys
from core.model import moe, expert_choice
from core.runtime.engine import Engine, Request
calls = [0]
inner = moe.experts
def counted(*a, **k):
    calls[0] += 1
    return inner(*a, **k)
moe.experts = counted
e = Engine.load(sys.argv[1], device="cpu", threads=1, cpu_math="float32")
e.eos_ids = set()
reqs = [Request(id=str(i), prompt=" ".join(["a"] * 40), max_new_tokens=1) for i in range(8)]
list(e.generate(reqs, batch_size=8))
print(json.dumps({"calls": calls[0], "layers": e.spec.num_layers, "chosen": len(expert_choice.chosen())}))
"""


@pytest.mark.slow
def test_a_second_process_runs_its_first_prefill_without_timing_the_experts(checkpoint_factory, tmp_path,
                                                                           shared_kernels):
    env = {**os.environ, "MLIGHT_CACHE_DIR": str(shared_kernels(tmp_path / "cache")), "MLIGHT_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    model = str(checkpoint_factory("mixtral"))

    def run() -> dict:
        out = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True,
                             check=True, timeout=300).stdout
        return json.loads(out.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["chosen"] >= 1
    assert first["calls"] > second["calls"]  # the first process timed both forms
    assert second["calls"] <= second["layers"] * 2  # the prefill's and the decode's call a layer, nothing timed
