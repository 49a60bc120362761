"""HardwareSpec: presets, JSON round-trip, NVML-less detection, probe cache."""

import json
import sys
import types

import pytest

from core.plan import hardware
from core.errors import UsageError
from core.plan.hardware import GB, GiB, HardwareSpec, preset


def test_bare_gpu_name_is_that_gpu_in_the_papers_host():
    t4 = preset("t4")
    assert (t4.gpu_count, t4.gpu_mem_bytes, t4.cpu_cores, t4.cpu_mem_bytes) == (1, 16 * GiB, 24, 192 * 10**9)
    assert t4.gpu_flops == 65e12 and t4.gpu_bw == 320 * GB
    # the paper's host caps the link at 16 GB/s; a T4's gen3 x16 is a bit below that
    assert t4.h2d_bw == pytest.approx(15.76 * GB) and preset("l4").h2d_bw == 16 * GB


def test_multi_gpu_preset_and_case_insensitivity():
    two = preset("2xT4")
    assert two.gpu_count == 2 and two.gpu_name == preset("t4").gpu_name
    assert two.cpu_mem_bytes == 416 * 10**9  # the paper's 2x/4x T4 host


@pytest.mark.parametrize("name", [*hardware._GPUS, *(f"{k}x{g}" for k in (2, 4) for g in hardware._GPUS)])
def test_every_preset_builds_and_round_trips(name):
    hw = preset(name)
    assert hw.has_gpu and hw.gpu_flops > 1e13 and hw.gpu_bw > 1e11
    assert HardwareSpec.from_json(hw.to_json()) == hw


def test_unknown_preset_names_the_choices():
    with pytest.raises(UsageError, match="t4"):
        preset("v100")


def test_spec_refuses_inconsistent_gpu_fields():
    with pytest.raises(ValueError):
        HardwareSpec(name="x", gpu_name="T4", gpu_count=0, gpu_mem_bytes=0, gpu_flops=0, gpu_bw=0, h2d_bw=0,
                     d2h_bw=0, cpu_flops=1e11, cpu_bw=1e10, cpu_mem_bytes=10**9, cpu_cores=4)
    with pytest.raises(ValueError):
        preset("t4").__class__(**{**preset("t4").to_dict(), "measured": ("nonsense",)})


def test_with_link_overrides_both_directions_and_forgets_the_measurement():
    hw = hardware._apply(preset("t4"), {"h2d_bw": 11e9, "cpu_bw": 50e9})
    assert "h2d_bw" in hw.measured
    fast = hw.with_link(32)
    assert fast.h2d_bw == fast.d2h_bw == 32 * GB and "h2d_bw" not in fast.measured and "cpu_bw" in fast.measured
    with pytest.raises(UsageError):
        hw.with_link(0)


def _raising_nvml(monkeypatch):
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def fail():
        raise NVMLError("NVML Shared Library Not Found")

    fake.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", fake)


def test_detect_without_nvml_is_a_cpu_only_machine(monkeypatch):
    _raising_nvml(monkeypatch)
    hw = hardware.detect()
    assert not hw.has_gpu and hw.gpu_name is None and hw.gpu_count == 0
    assert hw.cpu_cores >= 1 and hw.cpu_mem_bytes > 0 and hw.cpu_mem_available_bytes <= hw.cpu_mem_bytes
    assert HardwareSpec.from_json(hw.to_json()) == hw


def test_detect_reads_gpus_and_the_pcie_link_from_nvml(monkeypatch):
    fake = types.SimpleNamespace(
        NVML_CLOCK_MEM=2,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA L4",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=24 * GiB, free=(20 + h) * GiB),
        nvmlDeviceGetMaxPcieLinkGeneration=lambda h: 4, nvmlDeviceGetMaxPcieLinkWidth=lambda h: 8,
        nvmlDeviceGetMemoryBusWidth=lambda h: 192, nvmlDeviceGetMaxClockInfo=lambda h, c: 6251,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    hw = hardware.detect()
    assert hw.gpu_name == "NVIDIA L4" and hw.gpu_count == 2
    assert hw.gpu_mem_free_bytes == 20 * GiB  # the tighter of the two
    assert hw.h2d_bw == pytest.approx(1.969 * 8 * GB) and hw.pcie == "gen4 x8"
    assert hw.gpu_flops == preset("l4").gpu_flops  # a known GPU takes its datasheet figures


def test_cache_dir_respects_env_and_falls_back_to_platformdirs(monkeypatch, tmp_path):
    monkeypatch.setenv("MLIGHT_CACHE_DIR", str(tmp_path / "c"))
    assert hardware.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MLIGHT_CACHE_DIR")
    import platformdirs

    assert str(hardware.cache_dir()) == platformdirs.user_cache_dir("mlight")


def test_probe_writes_the_cache_and_reads_it_back(monkeypatch, tmp_path):
    monkeypatch.setenv("MLIGHT_CACHE_DIR", str(tmp_path))
    _raising_nvml(monkeypatch)
    calls = []

    def measure(hw, seconds):
        calls.append(seconds)
        return {"cpu_flops": 123e9, "cpu_bw": 45e9, "h2d_bw": 9e9}  # no GPU: the link figure is dropped

    hw = hardware.probe(measure=measure)
    path = hardware.probe_cache_path(hw)
    assert path.is_file() and path.is_relative_to(tmp_path)
    assert json.loads(path.read_text())["rates"]["cpu_bw"] == 45e9
    assert (hw.cpu_flops, hw.cpu_bw, hw.source) == (123e9, 45e9, "probe")
    assert set(hw.measured) == {"cpu_flops", "cpu_bw"}

    def must_not_run(hw, seconds):
        raise AssertionError("the cache should have answered")

    again = hardware.probe(measure=must_not_run)
    assert (again.cpu_flops, again.cpu_bw, again.measured) == (hw.cpu_flops, hw.cpu_bw, hw.measured)
    assert len(calls) == 1
    hardware.probe(refresh=True, measure=measure)
    assert len(calls) == 2


def test_damaged_cache_is_measured_again(monkeypatch, tmp_path):
    monkeypatch.setenv("MLIGHT_CACHE_DIR", str(tmp_path))
    _raising_nvml(monkeypatch)
    base = hardware.detect()
    path = hardware.probe_cache_path(base)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    hw = hardware.probe(base, measure=lambda hw, s: {"cpu_flops": 1e11, "cpu_bw": 2e10})
    assert hw.cpu_bw == 2e10 and json.loads(path.read_text())["rates"]["cpu_flops"] == 1e11


def test_resolve_reads_presets_files_and_overrides_the_link(tmp_path):
    f = tmp_path / "box.json"
    f.write_text(preset("l4").to_json())
    assert hardware.resolve(str(f)) == preset("l4")
    assert hardware.resolve("t4", pcie_gbps=32).h2d_bw == 32 * GB
    with pytest.raises(UsageError, match="hardware"):
        hardware.resolve(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text('{"name": "x"}')
    with pytest.raises(UsageError, match="not a hardware description"):
        hardware.resolve(str(tmp_path / "bad.json"))


_WRITER = """
import sys
from pathlib import Path
from core.plan.hardware import _write_json
path, tag = Path(sys.argv[1]), sys.argv[2]
for i in range(100):
    _write_json(path, {"writer": tag, "i": i, "pad": "x" * 4000})
"""


def test_concurrent_probe_cache_writers_never_collide(tmp_path):
    """Two data-parallel ranks probing at once (two processes), and two threads of one process: every
    write lands whole, none fails, no temporary file is left behind."""
    import os
    import subprocess
    import threading

    path = tmp_path / "probe" / "v2-machine.json"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), f"p{n}"], env={**os.environ, "PYTHONPATH": os.getcwd()})
             for n in range(2)]
    errors = []

    def write(tag):
        try:
            for i in range(100):
                hardware._write_json(path, {"writer": tag, "i": i, "pad": "x" * 4000})
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=write, args=(f"t{n}",)) for n in range(2)]
    for t in threads:
        t.start()
    seen = set()
    while any(t.is_alive() for t in threads) or any(p.poll() is None for p in procs):
        if path.is_file():
            seen.add(json.loads(path.read_text(encoding="utf-8"))["writer"])  # never half a file
    for t in threads:
        t.join()
    assert [p.wait() for p in procs] == [0, 0]
    assert errors == []
    assert json.loads(path.read_text(encoding="utf-8"))["i"] == 99
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert seen  # the reader did look while they wrote


def test_probe_cache_is_replaced_while_windows_holds_it_open(monkeypatch, tmp_path):
    """On Windows a reader holding the old file makes the rename fail for a moment; the write waits."""
    import os

    from core import platform as plat

    monkeypatch.setattr(plat, "SYSTEM", "windows")
    monkeypatch.setattr(plat, "_sleep", lambda s: None)
    real, calls = os.replace, []

    def busy_once(src, dst):
        calls.append(dst)
        if len(calls) == 1:
            raise PermissionError(13, "The process cannot access the file because it is being used by another process")
        real(src, dst)

    monkeypatch.setattr(os, "replace", busy_once)
    path = tmp_path / "probe.json"
    path.write_text("{}")
    hardware._write_json(path, {"rates": {"cpu_bw": 1.0}})
    assert json.loads(path.read_text())["rates"] == {"cpu_bw": 1.0} and len(calls) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["probe.json"]
