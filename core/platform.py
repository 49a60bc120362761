"""What differs between operating systems, decided in one place (a leaf: it imports nothing from core's packages);
every function reads `SYSTEM` at call time, so a test that sets it runs the Windows branches on any machine."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import platformdirs
import psutil

SYSTEM = {"win32": "windows", "darwin": "macos"}.get(sys.platform, sys.platform)  # tests switch it (monkeypatch)
WINDOWS_MAX_PATH = 260  # characters, terminating NUL included (MAX_PATH)
SHARING_RETRY_S = 2.0  # how long to wait for another process to let go of a file on Windows
_sleep = time.sleep  # tests replace it so retries cost no time
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def is_windows() -> bool:
    return SYSTEM == "windows"


def cgroup_cpu_quota(path: str | Path | None = None) -> float | None:
    """CPUs a Linux container may use (`docker --cpus`), from cgroup v2's cpu.max; None when unlimited."""
    try:
        quota, period = Path(path or CGROUP_CPU_MAX).read_text(encoding="ascii").split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """Logical CPUs this process may run on: its affinity mask capped by a container's CPU quota; at least 1."""
    n = None
    if SYSTEM == "linux" and hasattr(os, "sched_getaffinity"):
        n = len(os.sched_getaffinity(0))
    elif SYSTEM == "windows" or SYSTEM.startswith("freebsd"):
        with contextlib.suppress(AttributeError, OSError):  # AttributeError: no affinity call on this system
            n = len(psutil.Process().cpu_affinity())
    n = n or os.cpu_count() or 1
    quota = cgroup_cpu_quota() if SYSTEM == "linux" else None
    return max(1, n if quota is None else min(n, int(quota)))  # 2.5 CPUs of quota: 2 threads run unthrottled


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages; None where the OS keeps none (Windows)."""
    try:
        return None if SYSTEM == "windows" else os.getloadavg()
    except (AttributeError, OSError):  # AttributeError: no getloadavg on this system
        return None


def free_cores(sample_s: float = 0.1) -> int:
    """Usable cores not busy now, by CPU utilisation over `sample_s` (the load average lags by a minute)."""
    usable = usable_cores()
    try:  # the load is machine-wide: its share on our cores
        busy = psutil.cpu_percent(interval=sample_s) / 100.0 * usable
    except OSError:
        return usable
    return max(1, usable - int(busy + 0.5))


DEFAULT_LLC = 16 << 20  # a typical desktop's last-level cache, where the OS does not say
LINUX_CACHE = "/sys/devices/system/cpu/cpu0/cache"
RELATION_CACHE = 2  # LOGICAL_PROCESSOR_RELATIONSHIP.RelationCache (Windows)


def llc_bytes() -> int:
    """The last-level cache's size as the OS reports it (Apple silicon: the performance cores' L2), else DEFAULT_LLC."""
    read = {"linux": _llc_linux, "macos": _llc_macos, "windows": _llc_windows}.get(SYSTEM)
    try:
        return (read() if read is not None else 0) or DEFAULT_LLC
    except (OSError, ValueError, AttributeError):  # AttributeError: no such library call on this system
        return DEFAULT_LLC


def _llc_linux() -> int:
    best = 0
    for f in Path(LINUX_CACHE).glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = f.read_text(encoding="ascii").strip().upper()  # "2048K", "32M", bytes, or empty
            best = max(best, int(text.rstrip("KM") or 0) * {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1))
    return best


def _llc_macos(libc=None) -> int:
    import ctypes
    import ctypes.util

    libc = libc or ctypes.CDLL(ctypes.util.find_library("c"))
    for name in (b"hw.l3cachesize", b"hw.perflevel0.l2cachesize", b"hw.l2cachesize"):
        value, size = ctypes.c_uint64(0), ctypes.c_size_t(8)  # 4- or 8-byte integers: little-endian either way
        if libc.sysctlbyname(name, ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)) == 0 \
                and value.value:
            return int(value.value)
    return 0


def _llc_windows(kernel32=None) -> int:
    import ctypes

    class Cache(ctypes.Structure):  # CACHE_DESCRIPTOR
        _fields_ = [("Level", ctypes.c_ubyte), ("Associativity", ctypes.c_ubyte), ("LineSize", ctypes.c_ushort),
                    ("Size", ctypes.c_uint32), ("Type", ctypes.c_uint32)]

    class Union(ctypes.Union):
        _fields_ = [("Cache", Cache), ("Reserved", ctypes.c_uint64 * 2)]

    class Info(ctypes.Structure):  # SYSTEM_LOGICAL_PROCESSOR_INFORMATION
        _fields_ = [("ProcessorMask", ctypes.c_size_t), ("Relationship", ctypes.c_uint32), ("u", Union)]

    k32 = kernel32 or ctypes.windll.kernel32  # AttributeError off Windows
    length = ctypes.c_uint32(0)
    k32.GetLogicalProcessorInformation(None, ctypes.byref(length))  # fails, saying how many bytes it needs
    count = length.value // ctypes.sizeof(Info)
    buf = (Info * count)()
    if not count or not k32.GetLogicalProcessorInformation(buf, ctypes.byref(length)):
        return 0
    records = buf[:min(count, length.value // ctypes.sizeof(Info))]
    return max((r.u.Cache.Size for r in records if r.Relationship == RELATION_CACHE), default=0)


def pinned_budget(ram_bytes: int) -> int:
    """Host memory worth page-locking: Windows (WDDM) caps it at half the RAM, past which registration fails."""
    return ram_bytes // 2 if SYSTEM == "windows" else ram_bytes


def stop_signals() -> tuple[int, ...]:
    """Signals that ask a run to stop cleanly on this OS (Windows never delivers SIGTERM; Ctrl-Break is SIGBREAK)."""
    names = ("SIGINT", "SIGBREAK") if SYSTEM == "windows" else ("SIGINT", "SIGTERM")
    return tuple(getattr(signal, n) for n in names if hasattr(signal, n))


def can_fsync_dir() -> bool:
    """Whether a folder can be fsynced to make a rename durable (not on Windows, where NTFS journals the rename)."""
    return SYSTEM != "windows"


def _retry_shared(op, *args) -> None:  # on Windows, retried while another process holds the file open
    deadline, delay = time.monotonic() + SHARING_RETRY_S, 0.02
    while True:
        try:
            return op(*args)
        except PermissionError:
            if SYSTEM != "windows" or time.monotonic() >= deadline:
                raise
            _sleep(delay)
            delay = min(delay * 2, 0.25)


def cache_dir() -> Path:
    """Where mlight caches per-machine data: $MLIGHT_CACHE_DIR, else platformdirs' user cache folder."""
    return Path(os.environ.get("MLIGHT_CACHE_DIR") or platformdirs.user_cache_dir("mlight"))


def replace(src: str | Path, dst: str | Path) -> None:
    """os.replace, waiting on Windows (up to SHARING_RETRY_S) for a reader of `dst` to close it."""
    _retry_shared(os.replace, src, dst)


def write_whole(path: str | Path, text: str) -> None:
    """`path` holds `text` whole or not at all: a temporary file beside it renamed over (`replace`), so a reader
    never sees half a file and racing writers each rename their own."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove(path: str | Path) -> None:
    """os.remove, waiting on Windows as `replace` (a missing file raises at once)."""
    _retry_shared(os.remove, path)


def path_too_long(path: str | Path) -> bool:
    """Whether `path` is past Windows' default limit (long paths are off unless a registry switch is on)."""
    if SYSTEM != "windows" or len(str(path)) < WINDOWS_MAX_PATH:
        return False
    try:
        import winreg

        with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, r"SYSTEM\CurrentControlSet\Control\FileSystem") as k:
            return not winreg.QueryValueEx(k, "LongPathsEnabled")[0]
    except (ImportError, OSError):
        return True


def utf8_console(streams=None) -> None:
    """Let stdout/stderr print any text: UTF-8 on Windows (redirected, it is the ANSI code page), else escapes."""
    for s in streams if streams is not None else (sys.stdout, sys.stderr):
        enc = (getattr(s, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        if enc in ("utf8", "utf8sig") or not hasattr(s, "reconfigure"):
            continue
        with contextlib.suppress(ValueError, OSError):  # already written to in a way that cannot change: leave it
            if SYSTEM == "windows":
                s.reconfigure(encoding="utf-8", errors="replace")
            else:
                s.reconfigure(errors="backslashreplace")


def terminal(env=None) -> str:
    """'windows-terminal', 'legacy-console' (conhost: fewer glyphs) or 'other' (POSIX terminals, VS Code, ConEmu)."""
    env = os.environ if env is None else env
    if SYSTEM != "windows":
        return "other"
    if env.get("WT_SESSION"):
        return "windows-terminal"
    if env.get("TERM_PROGRAM") or env.get("ConEmuANSI") == "ON" or env.get("TERM"):
        return "other"
    return "legacy-console"
