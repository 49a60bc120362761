"""What differs between operating systems, decided in one place.

Every branch mlight takes on the OS goes through this module, so that the Windows branches run — and
are tested — on any machine: a test sets `SYSTEM` ("linux", "windows", "macos") with monkeypatch, and
every function here reads it at call time. A leaf: it imports nothing from core's packages.

- CPUs: `usable_cores` (the affinity mask and a container's CPU quota; Windows and macOS have no
  `os.sched_getaffinity`), `load_average` (None on Windows, which has none), `free_cores` (usable cores
  not busy with other work — the default thread count).
- GPU copies: `pinned_budget` (WDDM on Windows caps page-locked memory at half the RAM).
- Stopping: `stop_signals` (Ctrl-C everywhere; SIGTERM on POSIX; Ctrl-Break — SIGBREAK — on Windows,
  where SIGTERM is never delivered: `taskkill /F` and TerminateProcess end a process without a signal).
- Files: `can_fsync_dir` (Windows cannot open a folder), `replace` / `remove` (Windows refuses while
  another process — a viewer, an indexer, an antivirus scan — has the file open: retry briefly),
  `path_too_long` (Windows' 260-character limit unless long paths are enabled).
- Console: `utf8_console` (a redirected Windows console encodes cp1252 and would crash on "→").
- Terminal: `terminal` (Windows Terminal, the legacy console, or anything else).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def _system() -> str:
    if sys.platform.startswith("win"):
        return "windows"
    if sys.platform == "darwin":
        return "macos"
    return "linux" if sys.platform.startswith("linux") else sys.platform


SYSTEM = _system()  # tests switch it: monkeypatch.setattr(core.platform, "SYSTEM", "windows")
WINDOWS_MAX_PATH = 260  # characters, terminating NUL included (MAX_PATH)
SHARING_RETRY_S = 2.0  # how long to wait for another process to let go of a file on Windows
_sleep = time.sleep  # tests replace it so retries cost no time
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def is_windows() -> bool:
    return SYSTEM == "windows"


# ---- CPUs --------------------------------------------------------------------------------------

def cgroup_cpu_quota(path: str | Path | None = None) -> float | None:
    """CPUs a Linux container may use (`docker --cpus`), from cgroup v2's cpu.max; None when unlimited."""
    try:
        quota, period = Path(path or CGROUP_CPU_MAX).read_text(encoding="ascii").split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """Logical CPUs this process may run on: its affinity mask (taskset, `start /affinity`, a job
    object) capped by a container's CPU quota. Never less than 1."""
    n = None
    if SYSTEM == "linux" and hasattr(os, "sched_getaffinity"):
        n = len(os.sched_getaffinity(0))
    elif SYSTEM == "windows" or SYSTEM.startswith("freebsd"):
        try:
            import psutil

            n = len(psutil.Process().cpu_affinity())
        except (ImportError, AttributeError, OSError):
            n = None
    n = n or os.cpu_count() or 1
    if SYSTEM == "linux":
        quota = cgroup_cpu_quota()
        if quota is not None:
            n = min(n, max(1, int(quota)))  # 2.5 CPUs of quota: 2 threads run unthrottled
    return max(1, n)


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages; None where the OS keeps none (Windows)."""
    if SYSTEM == "windows" or not hasattr(os, "getloadavg"):
        return None
    try:
        return os.getloadavg()
    except OSError:
        return None


def free_cores(sample_s: float = 0.1) -> int:
    """Usable cores not busy with other work: a sensible default for CPU threads. POSIX reads the
    1-minute load average; Windows, which has none, samples CPU utilisation for `sample_s` seconds."""
    usable = usable_cores()
    total = os.cpu_count() or usable
    load = load_average()
    if load is not None:
        busy = load[0]
    else:
        try:
            import psutil

            busy = psutil.cpu_percent(interval=sample_s) / 100.0 * total
        except (ImportError, OSError):
            return usable
    # the load is machine-wide; count the share of it that falls on our cores
    busy_here = busy * usable / max(total, 1)
    return max(1, usable - int(busy_here + 0.5))


def pinned_budget(ram_bytes: int) -> int:
    """Host memory worth page-locking for GPU copies. Under Windows' WDDM driver model page-locked memory
    is mapped as the GPU's shared system memory, which Windows caps at half the RAM (Task Manager's
    "Shared GPU memory"): past that, registration fails or the machine starts paging. Elsewhere the OS
    sets no such cap."""
    return ram_bytes // 2 if SYSTEM == "windows" else ram_bytes


# ---- stopping ----------------------------------------------------------------------------------

def stop_signals() -> tuple[int, ...]:
    """Signals that ask a run to stop cleanly, as this OS delivers them."""
    names = ("SIGINT", "SIGBREAK") if SYSTEM == "windows" else ("SIGINT", "SIGTERM")
    return tuple(getattr(signal, n) for n in names if hasattr(signal, n))


# ---- files -------------------------------------------------------------------------------------

def can_fsync_dir() -> bool:
    """Whether a folder can be opened and fsynced to make a rename durable (not on Windows, where NTFS
    journals the rename itself)."""
    return SYSTEM != "windows"


def _retry_shared(op, *args) -> None:
    """Run a file operation; on Windows retry it while another process holds the file open."""
    if SYSTEM != "windows":
        op(*args)
        return
    deadline = time.monotonic() + SHARING_RETRY_S
    delay = 0.02
    while True:
        try:
            op(*args)
            return
        except PermissionError:
            if time.monotonic() >= deadline:
                raise
            _sleep(delay)
            delay = min(delay * 2, 0.25)


def replace(src: str | Path, dst: str | Path) -> None:
    """os.replace, waiting on Windows (up to SHARING_RETRY_S) for a reader of `dst` to close it."""
    _retry_shared(os.replace, src, dst)


def remove(path: str | Path) -> None:
    """os.remove, waiting on Windows for another process to close the file (a missing file raises at once)."""
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


# ---- console -----------------------------------------------------------------------------------

def utf8_console(streams=None) -> None:
    """Make stdout/stderr able to print any text. On Windows a console already takes Unicode, but output
    redirected to a file or pipe is encoded in the ANSI code page (cp1252): switch it to UTF-8. Elsewhere
    a non-UTF-8 locale keeps its encoding and escapes what it cannot encode instead of crashing."""
    for s in streams if streams is not None else (sys.stdout, sys.stderr):
        enc = (getattr(s, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        if enc in ("utf8", "utf8sig") or not hasattr(s, "reconfigure"):
            continue
        try:
            if SYSTEM == "windows":
                s.reconfigure(encoding="utf-8", errors="replace")
            else:
                s.reconfigure(errors="backslashreplace")
        except (ValueError, OSError):  # already written to in a way that cannot change; leave it
            pass


def terminal(env=None) -> str:
    """'windows-terminal', 'legacy-console' (conhost: fewer glyphs, no true colour on old builds) or
    'other' (any POSIX terminal, VS Code, ConEmu)."""
    env = os.environ if env is None else env
    if SYSTEM != "windows":
        return "other"
    if env.get("WT_SESSION"):
        return "windows-terminal"
    if env.get("TERM_PROGRAM") or env.get("ConEmuANSI") == "ON" or env.get("TERM"):
        return "other"
    return "legacy-console"
