"""Every host wait on GPU work has a deadline, the setup probes' too (core.model.device_wait): a hung
probe kernel raises DeviceStalled naming it, where torch.cuda.synchronize would hang the process."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from core.model.device_wait import DeviceStalled, synchronize

CORE = Path(__file__).resolve().parent.parent / "core"


class FakeEvent:
    """A CUDA event whose recorded work completes after `FakeEvent.after` queries (never when None)."""

    after: int | None = None

    def __init__(self):
        self.recorded, self.queries = [], 0

    def record(self, stream=None):
        self.recorded.append(stream)
        FakeEvent.last = self

    def query(self) -> bool:
        self.queries += 1
        return self.after is not None and self.queries > self.after


def test_a_probe_wait_returns_once_the_recorded_work_completes(monkeypatch):
    monkeypatch.setattr(FakeEvent, "after", 3)
    stream = object()
    synchronize("the probe", seconds=5, event=FakeEvent, stream=stream)
    assert FakeEvent.last.recorded == [stream] and FakeEvent.last.queries == 4


def test_a_hung_probe_raises_within_its_deadline_naming_it(monkeypatch):
    monkeypatch.setattr(FakeEvent, "after", None)
    t0 = time.monotonic()
    with pytest.raises(DeviceStalled, match="the grouped_mm probe did not complete on the device within 0.2 s"):
        synchronize("the grouped_mm probe", seconds=0.2, event=FakeEvent, stream=object())
    assert 0.2 <= time.monotonic() - t0 < 2
    assert FakeEvent.last.queries > 100  # it spins (a timed probe reads the work's own time), it does not sleep


def test_the_deadline_is_the_devices_own_by_default(monkeypatch):
    monkeypatch.setenv("MLIGHT_DEVICE_WAIT_S", "0.1")
    monkeypatch.setattr(FakeEvent, "after", None)
    with pytest.raises(DeviceStalled, match="within 0.1 s"):
        synchronize("the GPU probe's timed work", event=FakeEvent, stream=object())


def test_the_runtime_and_the_probes_share_one_deadline_and_error():
    from core.runtime import device

    assert device.DeviceStalled is DeviceStalled and device.poll.__module__ == "core.model.device_wait"


def test_nothing_in_core_waits_on_the_gpu_without_a_deadline():
    """The grouped_mm probe and the expert-form timing (core.model.moe) and the GPU rate probe
    (core.plan.hardware) called torch.cuda.synchronize: a hung kernel there hung `mlight hw`, the
    app's first screen and the engine's load with no message."""
    bad = []
    for f in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "synchronize" and ast.unparse(node.value) == "torch.cuda":
                bad.append(f"{f.relative_to(CORE.parent)}:{node.lineno}")
    assert bad == []
