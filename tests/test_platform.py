"""core.platform: each OS branch, switched with `SYSTEM`, so the Windows ones run on any machine."""

from __future__ import annotations

import functools
import io
import os
import signal

import pytest

from core import platform


@pytest.fixture
def windows(monkeypatch):
    monkeypatch.setattr(platform, "SYSTEM", "windows")
    monkeypatch.setattr(platform, "_sleep", lambda s: None)


@pytest.fixture
def linux(monkeypatch):
    monkeypatch.setattr(platform, "SYSTEM", "linux")
    monkeypatch.setattr(platform, "CGROUP_CPU_MAX", "/nonexistent/cpu.max")


def _forbid(monkeypatch, obj, name):
    def refuse(*a, **k):
        raise AssertionError(f"{name} called on the Windows branch")

    monkeypatch.setattr(obj, name, refuse, raising=False)


# ---- CPUs --------------------------------------------------------------------------------------

def test_usable_cores_follows_the_affinity_mask_on_linux(linux, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert platform.usable_cores() == 3


def test_usable_cores_is_capped_by_a_container_quota(linux, monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    f = tmp_path / "cpu.max"
    f.write_text("250000 100000\n", encoding="ascii")  # docker --cpus=2.5
    monkeypatch.setattr(platform, "CGROUP_CPU_MAX", str(f))
    assert platform.usable_cores() == 2
    f.write_text("max 100000\n", encoding="ascii")
    assert platform.usable_cores() == 16


def test_cgroup_quota_parsing(tmp_path):
    f = tmp_path / "cpu.max"
    f.write_text("max 100000\n", encoding="ascii")
    assert platform.cgroup_cpu_quota(f) is None
    f.write_text("150000 100000\n", encoding="ascii")
    assert platform.cgroup_cpu_quota(f) == 1.5
    assert platform.cgroup_cpu_quota(tmp_path / "absent") is None
    f.write_text("garbage\n", encoding="ascii")
    assert platform.cgroup_cpu_quota(f) is None


def test_usable_cores_on_windows_asks_psutil_not_sched_getaffinity(windows, monkeypatch):
    import psutil

    _forbid(monkeypatch, os, "sched_getaffinity")
    monkeypatch.setattr(psutil.Process, "cpu_affinity", lambda self, cpus=None: [0, 1, 2, 3, 4, 5], raising=False)
    assert platform.usable_cores() == 6


def test_usable_cores_on_windows_without_affinity_support_counts_cpus(windows, monkeypatch):
    import psutil

    _forbid(monkeypatch, os, "sched_getaffinity")
    monkeypatch.delattr(psutil.Process, "cpu_affinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    assert platform.usable_cores() == 12


def test_load_average_is_none_on_windows(windows, monkeypatch):
    _forbid(monkeypatch, os, "getloadavg")
    assert platform.load_average() is None


def test_llc_bytes_reads_linux_sysfs(linux, monkeypatch, tmp_path):
    for i, size in enumerate(("48K", "2048K", "32M", "")):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n", encoding="ascii")
    monkeypatch.setattr(platform, "LINUX_CACHE", str(tmp_path))
    assert platform.llc_bytes() == 32 << 20


class _FakeKernel32:
    """GetLogicalProcessorInformation as Windows answers it: a first call saying how many bytes it needs,
    then the records — here an L1, an L2 and a 36 MB L3, and a core record that is no cache."""

    def __init__(self):
        self.calls = 0

    def GetLogicalProcessorInformation(self, buf, length):  # noqa: N802 - the Win32 name
        self.calls += 1
        rows = [(1, 1, 48 << 10), (1, 1, 48 << 10), (1, 2, 2 << 20), (0, 0, 0), (1, 3, 36 << 20)]
        size = 32  # the 64-bit record: mask, relationship, 16-byte union
        if buf is None:
            length._obj.value = size * len(rows)
            return 0
        for r, (relation_is_cache, level, cache) in zip(buf, rows):
            r.Relationship = 2 if relation_is_cache else 0
            r.u.Cache.Level, r.u.Cache.Size = level, cache
        return 1


class _FakeLibc:
    """sysctlbyname with Apple silicon's keys: no hw.l3cachesize; the performance cores' L2 is 16 MB."""

    def __init__(self, values):
        self.values = values

    def sysctlbyname(self, name, value, size, new, new_size):
        if name not in self.values:
            return -1
        value._obj.value = self.values[name]
        return 0


def test_llc_bytes_asks_windows_and_macos_themselves(windows, monkeypatch):
    """Elsewhere than Linux the answer was always 16 MiB: Windows' record list and macOS's sysctl give the
    machine's own (no POSIX call on Windows: only kernel32, through ctypes)."""
    k32 = _FakeKernel32()
    monkeypatch.setattr(platform, "_llc_windows", functools.partial(platform._llc_windows, k32))
    assert platform.llc_bytes() == 36 << 20 and k32.calls == 2
    monkeypatch.setattr(platform, "SYSTEM", "macos")
    macos = platform._llc_macos
    monkeypatch.setattr(platform, "_llc_macos", functools.partial(macos, _FakeLibc({
        b"hw.perflevel0.l2cachesize": 16 << 20, b"hw.l2cachesize": 4 << 20})))
    assert platform.llc_bytes() == 16 << 20
    monkeypatch.setattr(platform, "_llc_macos", functools.partial(macos, _FakeLibc({b"hw.l3cachesize": 12 << 20})))
    assert platform.llc_bytes() == 12 << 20
    monkeypatch.setattr(platform, "_llc_macos", functools.partial(macos, _FakeLibc({})))
    assert platform.llc_bytes() == platform.DEFAULT_LLC  # nothing to read: the typical desktop's


@pytest.mark.skipif(hasattr(__import__("ctypes"), "windll"), reason="on Windows the call exists")
def test_llc_bytes_falls_back_where_the_call_is_missing(windows):
    assert platform.llc_bytes() == platform.DEFAULT_LLC  # the Windows branch off Windows: no ctypes.windll


def test_free_cores_subtracts_the_busy_cores_on_linux(linux, monkeypatch):
    """Utilisation now, not the 1-minute load average: that still counts a run that ended seconds ago, and a probe
    started then measured one core's memory bandwidth."""
    import psutil

    _forbid(monkeypatch, os, "getloadavg")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    seen = []
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: seen.append(interval) or 32.5)  # 2.6 cores
    assert platform.free_cores(sample_s=0.05) == 5 and seen == [0.05]
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 100.0)
    assert platform.free_cores() == 1  # never zero


def test_free_cores_counts_only_our_share_of_the_load(linux, monkeypatch):
    import psutil

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)  # 4 of 16 cores
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 50.0)  # 8 cores' worth, machine-wide
    assert platform.free_cores() == 2


def test_free_cores_on_windows_samples_utilisation(windows, monkeypatch):
    import psutil

    _forbid(monkeypatch, os, "getloadavg")
    monkeypatch.setattr(psutil.Process, "cpu_affinity", lambda self, cpus=None: list(range(8)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    seen = []
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: seen.append(interval) or 25.0)
    assert platform.free_cores(sample_s=0.05) == 6
    assert seen == [0.05]


def test_pinned_budget_is_half_the_ram_under_wddm(monkeypatch):
    monkeypatch.setattr(platform, "SYSTEM", "windows")
    assert platform.pinned_budget(64 * 2**30) == 32 * 2**30
    monkeypatch.setattr(platform, "SYSTEM", "linux")
    assert platform.pinned_budget(64 * 2**30) == 64 * 2**30


# ---- signals -----------------------------------------------------------------------------------

def test_stop_signals_posix(linux):
    assert platform.stop_signals() == (signal.SIGINT, signal.SIGTERM)


def test_stop_signals_windows_is_ctrl_c_and_ctrl_break(windows, monkeypatch):
    monkeypatch.setattr(signal, "SIGBREAK", 21, raising=False)  # its number on Windows
    assert platform.stop_signals() == (signal.SIGINT, 21)


# ---- files -------------------------------------------------------------------------------------

def test_can_fsync_dir(monkeypatch):
    monkeypatch.setattr(platform, "SYSTEM", "windows")
    assert not platform.can_fsync_dir()
    monkeypatch.setattr(platform, "SYSTEM", "linux")
    assert platform.can_fsync_dir()


class _HeldOpen:
    """os.replace / os.remove as Windows answers while another process holds the file: PermissionError
    for the first `times` calls, then the real operation."""

    def __init__(self, real, times):
        self.real, self.left, self.calls = real, times, 0

    def __call__(self, *args):
        self.calls += 1
        if self.left:
            self.left -= 1
            raise PermissionError(13, "The process cannot access the file because it is being used by another "
                                      "process")
        return self.real(*args)


def test_replace_waits_for_a_reader_on_windows(windows, monkeypatch, tmp_path):
    src, dst = tmp_path / "new", tmp_path / "out.jsonl"
    src.write_text("new", encoding="utf-8")
    dst.write_text("old", encoding="utf-8")
    held = _HeldOpen(os.replace, 3)
    monkeypatch.setattr(os, "replace", held)
    platform.replace(src, dst)
    assert held.calls == 4 and dst.read_text(encoding="utf-8") == "new" and not src.exists()


def test_replace_gives_up_after_the_deadline_on_windows(windows, monkeypatch, tmp_path):
    monkeypatch.setattr(platform, "SHARING_RETRY_S", 0.05)
    held = _HeldOpen(os.replace, 10**9)
    monkeypatch.setattr(os, "replace", held)
    with pytest.raises(PermissionError):
        platform.replace(tmp_path / "a", tmp_path / "b")
    assert held.calls > 1


def test_replace_does_not_retry_on_posix(linux, monkeypatch, tmp_path):
    held = _HeldOpen(os.replace, 1)
    monkeypatch.setattr(os, "replace", held)
    with pytest.raises(PermissionError):
        platform.replace(tmp_path / "a", tmp_path / "b")
    assert held.calls == 1


def test_remove_waits_on_windows_and_missing_raises_at_once(windows, monkeypatch, tmp_path):
    f = tmp_path / "OUT.run.jsonl"
    f.write_text("x", encoding="utf-8")
    held = _HeldOpen(os.remove, 2)
    monkeypatch.setattr(os, "remove", held)
    platform.remove(f)
    assert not f.exists() and held.calls == 3
    with pytest.raises(FileNotFoundError):
        platform.remove(f)
    assert held.calls == 4


def test_path_too_long_only_on_windows(monkeypatch):
    long = "C:\\Users\\someone\\" + "x" * 260 + "\\out.jsonl"
    monkeypatch.setattr(platform, "SYSTEM", "linux")
    assert not platform.path_too_long(long)
    monkeypatch.setattr(platform, "SYSTEM", "windows")
    assert platform.path_too_long(long)  # no winreg here: long paths count as off, as they are by default
    assert not platform.path_too_long("C:\\Users\\someone\\out.jsonl")


# ---- console -----------------------------------------------------------------------------------

def _console(encoding):
    raw = io.BytesIO()
    return raw, io.TextIOWrapper(raw, encoding=encoding, errors="strict", write_through=True)


def test_utf8_console_on_windows_writes_utf8_to_a_redirected_cp1252_stream(windows):
    raw, out = _console("cp1252")
    with pytest.raises(UnicodeEncodeError):
        out.write("3 rejected → out.rejected.jsonl")
    platform.utf8_console([out])
    out.write("3 rejected → out.rejected.jsonl · 東京")
    assert raw.getvalue().decode("utf-8").endswith("3 rejected → out.rejected.jsonl · 東京")


def test_utf8_console_elsewhere_escapes_instead_of_crashing(linux):
    raw, out = _console("latin-1")
    platform.utf8_console([out])
    out.write("é → x")
    assert raw.getvalue() == "é \\u2192 x".encode("latin-1")


def test_utf8_console_leaves_utf8_streams_alone(windows):
    raw, out = _console("utf-8")
    platform.utf8_console([out])
    assert out.errors == "strict"


def test_terminal_kinds(monkeypatch):
    monkeypatch.setattr(platform, "SYSTEM", "windows")
    assert platform.terminal({"WT_SESSION": "b2f1"}) == "windows-terminal"
    assert platform.terminal({}) == "legacy-console"
    assert platform.terminal({"TERM_PROGRAM": "vscode"}) == "other"
    assert platform.terminal({"ConEmuANSI": "ON"}) == "other"
    monkeypatch.setattr(platform, "SYSTEM", "linux")
    assert platform.terminal({}) == "other"


def test_the_real_system_is_recognised():
    assert platform.SYSTEM in ("linux", "macos", "windows") or platform.SYSTEM.startswith("freebsd")
    assert platform.usable_cores() >= 1 and platform.free_cores(sample_s=0.0) >= 1


def test_every_cached_thing_lands_under_one_folder_with_windows_conventions(monkeypatch, tmp_path):
    """platformdirs on Windows puts `appauthor` in the path (default: the app's name; False: none), so a cache
    asked for with other arguments lands in another folder: each of mlight's caches must use core.platform's."""
    import platformdirs

    from core.io.runstore import RunStore
    from core.model import demo, expert_choice
    from core.model.quant import cache as quant_cache
    from core.plan import cpu_cost, hardware

    def windows_cache(appname=None, appauthor=None, version=None, opinion=True, ensure_exists=False):
        author = appname if appauthor is None else appauthor  # platformdirs' Windows rule
        parts = [p for p in (author or None, appname) if p]
        return str(tmp_path.joinpath("AppData", "Local", *parts, "Cache"))

    monkeypatch.setattr(platformdirs, "user_cache_dir", windows_cache)
    monkeypatch.delenv("MLIGHT_CACHE_DIR", raising=False)
    root = platform.cache_dir()
    hw = hardware.preset("t4")
    paths = [demo.cache_dir(), quant_cache.cache_root(), expert_choice._path(), hardware.probe_cache_path(hw),
             cpu_cost.cache_path(hw), RunStore(tmp_path / "out.jsonl").ledger_path]
    assert root == tmp_path / "AppData" / "Local" / "mlight" / "mlight" / "Cache"
    assert all(root in p.parents or p == root for p in paths), [str(p) for p in paths]
