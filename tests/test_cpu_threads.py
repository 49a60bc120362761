"""Threads follow the cores actually free; the attention worker and the compute thread get disjoint cores."""

from __future__ import annotations

import os
import threading

import pytest

from core.model.cpu import threads
from core.model.cpu.threads import Governor, free_threads, split


def test_free_threads_leave_a_busy_core_to_its_owner():
    assert free_threads(0.0, 2) == 2
    assert free_threads(1.0, 2) == 1  # a neighbour busy on one core of two: one thread, no stalled barriers
    assert free_threads(0.2, 2) == 2  # a core a fifth busy still adds more than it stalls
    assert free_threads(5.0, 2) == 1  # never fewer than one
    assert free_threads(2.5, 16) == 14


class FakeMeter:
    def __init__(self, loads, cores=2):
        self.cores, self.loads, self.age = list(range(cores)), list(loads), 10.0

    def others(self):
        return self.loads.pop(0)


def test_governor_follows_the_load_between_steps():
    seen = []
    g = Governor(every_s=0.0, set_threads=seen.append, meter=FakeMeter([0.0, 1.1, 1.0, 0.1]))
    assert [g.tick() for _ in range(4)] == [2, 1, 1, 2]
    assert seen == [2, 1, 2]  # torch is told only when the count changes


def test_governor_checks_no_more_often_than_asked():
    meter = FakeMeter([0.0, 1.5])
    g = Governor(every_s=5.0, set_threads=lambda n: None, meter=meter)
    g.tick()
    meter.age = 1.0  # too soon: no psutil read, no change
    assert g.tick() == 2 and meter.loads == [1.5]


def test_fixed_threads_are_kept_whatever_the_load():
    seen = []
    g = Governor(fixed=3, set_threads=seen.append)
    assert [g.tick(), g.tick()] == [3, 3] and seen == [3] and g.meter is None
    with pytest.raises(ValueError):
        Governor(fixed=0)


def test_load_meter_subtracts_our_own_use(monkeypatch):
    meter = threads.LoadMeter([0, 1])
    monkeypatch.setattr(threads.psutil, "cpu_percent", lambda percpu=False: [100.0, 60.0, 100.0])
    monkeypatch.setattr(meter._me, "cpu_percent", lambda: 90.0)
    assert meter.others() == pytest.approx(0.7)  # cores 0 and 1 only, minus our 0.9 core


def test_split_gives_attention_and_compute_disjoint_cores():
    assert split([0, 1], "cpu") == ([0], [1])
    assert split(list(range(8)), "cuda") == ([0], list(range(1, 8)))  # the launching thread needs one core
    assert split(list(range(8)), "cpu") == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert split([3], "cpu") == ([3], [3])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="per-thread affinity is read on Linux only")
def test_pinning_a_thread_leaves_the_others_alone():
    mine = os.sched_getaffinity(0)
    target = [min(mine)]
    seen = {}

    def work():
        seen["ok"] = threads.pin_current_thread(target)
        seen["inside"] = os.sched_getaffinity(0)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == {"ok": True, "inside": set(target)} and os.sched_getaffinity(0) == mine
    assert threads.pin_current_thread([]) is False


def test_mlight_run_threads_reach_the_engine(demo_model, tmp_path, monkeypatch):
    from app.cli import main
    from core.runtime.engine import Engine

    prompts = tmp_path / "p.txt"
    prompts.write_text("Hi\nHello there\n", encoding="utf-8")
    made, real = [], Engine.load.__func__

    def load(cls, *a, **kw):
        made.append(real(cls, *a, **kw))
        return made[-1]

    monkeypatch.setattr(Engine, "load", classmethod(load))
    assert main(["run", "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"), "--max-new-tokens", "2",
                 "--threads", "1"]) == 0
    assert made and made[0].threads.fixed == 1 and made[0].threads.threads == 1


@pytest.mark.skipif(len(threads.allowed_cores()) < 2 or not hasattr(os, "sched_setaffinity"),
                    reason="needs two cores and per-thread affinity (Linux)")
def test_threaded_engine_puts_attention_and_compute_on_disjoint_cores(demo_model):
    from core.runtime.engine import Engine, Request

    engine = Engine.load(demo_model, executor="threaded")
    try:
        list(engine.generate([Request(id="a", prompt="Hi", max_new_tokens=2)]))
        pinned = engine._executor._setup.pinned
        assert set(pinned) >= {"compute", "cpu_attn"}
        assert not set(pinned["compute"]) & set(pinned["cpu_attn"])
        assert engine.threads.fixed == len(pinned["cpu_attn"])  # each team as large as its cores
    finally:
        engine.close()
