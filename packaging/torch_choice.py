#!/usr/bin/env python3
"""Which build of torch fits this machine: the detection both mlight installers run.

Reads the NVIDIA driver with `nvidia-smi` (or NVML, when nvidia-smi is not found) and picks the newest
CUDA build of torch that the driver can run and that is compiled for every GPU's architecture; the
CPU build when there is no usable NVIDIA GPU; the default build from the package index on macOS.
`--cpu` and `--cuda VERSION` override the detection.

    python torch_choice.py [--cpu | --cuda 12.8] [--system linux|windows|macos] [--json]

Prints what it found and why on stderr, and the choice on stdout: `cpu`, `cu128`-style (a value for
`uv --torch-backend`), or `default`; `--json` prints everything as one JSON object instead. Exit 2 for
a bad `--cuda`. Standard library only, Python 3.8+: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Tuple

Version = Tuple[int, int]

# CUDA builds torch publishes on its own wheel index, newest first, with the GPU architectures
# (compute capability) each is compiled for. CUDA 12.8+ builds dropped Maxwell and Pascal (5.x, 6.x),
# CUDA 13 dropped Volta (7.0); Blackwell (10.0, 12.0) needs 12.8+. Update with torch's release notes.
CUDA_BUILDS = (
    ((13, 0), (7, 5), (12, 0)),
    ((12, 8), (7, 0), (12, 0)),
    ((12, 6), (5, 0), (9, 0)),
)
# The CUDA version a driver supports, by driver branch, for drivers whose nvidia-smi does not print it.
DRIVER_CUDA = ((580, (13, 0)), (575, (12, 9)), (570, (12, 8)), (560, (12, 6)), (555, (12, 5)), (550, (12, 4)),
               (545, (12, 3)), (535, (12, 2)), (530, (12, 1)), (525, (12, 0)), (520, (11, 8)), (450, (11, 0)))
SMI_TIMEOUT_S = 20
QUERY = "--query-gpu=name,compute_cap,memory.total"
SMI_PLACES = {  # where nvidia-smi lives when it is not on PATH
    "linux": ("/usr/bin/nvidia-smi", "/usr/lib/wsl/lib/nvidia-smi"),  # the second: WSL 2
    "windows": (r"C:\Windows\System32\nvidia-smi.exe", r"C:\Program Files\NVIDIA Corporation\NVSMI\nvidia-smi.exe"),
}


@dataclass
class Gpu:
    name: str
    compute: Optional[Version] = None  # compute capability; None when the driver cannot say
    memory_mib: Optional[int] = None


@dataclass
class Detection:
    status: str  # "gpu": a driver answered with GPUs; "none": no NVIDIA driver or GPU; "broken": it failed
    source: str = ""  # "nvidia-smi" or "nvml"
    driver: str = ""
    cuda: Optional[Version] = None  # the newest CUDA the driver supports
    gpus: List[Gpu] = field(default_factory=list)
    problem: str = ""  # for "broken": what the tool said


@dataclass
class Choice:
    backend: str  # "cpu", "default", or "cuXYZ" (uv's --torch-backend value)
    why: str
    notes: List[str] = field(default_factory=list)
    detection: Optional[Detection] = None


def version(text: str) -> Optional[Version]:
    m = re.match(r"^\s*(?:cu)?(\d+)\.(\d+)\s*$", text) or re.match(r"^\s*cu(\d{2})(\d)\s*$", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _v(v: Version) -> str:
    return f"{v[0]}.{v[1]}"


def backend_name(cuda: Version) -> str:
    return f"cu{cuda[0]}{cuda[1]}"


# ---- reading the driver ------------------------------------------------------------------------

def parse_smi(header: str, query: str = "") -> Detection:
    """Read `nvidia-smi` (its banner) and `nvidia-smi --query-gpu=...` output."""
    drv = re.search(r"Driver Version:\s*([\d.]+)", header)
    if not drv:
        return Detection("broken", "nvidia-smi", problem=_first_line(header) or "nvidia-smi printed nothing")
    cuda_m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", header)
    cuda = (int(cuda_m.group(1)), int(cuda_m.group(2))) if cuda_m else cuda_for_driver(drv.group(1))
    gpus = []
    for line in query.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if not cells[0] or cells[0].lower().startswith("name"):
            continue
        cc = version(cells[1]) if len(cells) > 1 else None
        mem = int(cells[2]) if len(cells) > 2 and cells[2].isdigit() else None
        gpus.append(Gpu(cells[0], cc, mem))
    if not gpus:  # an old driver that refuses compute_cap: the banner's table still names the GPUs
        gpus = [Gpu(m.group(1).strip()) for m in re.finditer(r"^\|\s+\d+\s+(.+?)\s{2,}(?:On|Off|WDDM|TCC)\s+\|", header,
                                                               re.M)]
    if not gpus:
        return Detection("none", "nvidia-smi", drv.group(1), cuda, problem="the driver lists no GPU")
    return Detection("gpu", "nvidia-smi", drv.group(1), cuda, gpus)


def cuda_for_driver(driver: str) -> Optional[Version]:
    try:
        branch = int(driver.split(".")[0])
    except ValueError:
        return None
    return next((cuda for first, cuda in DRIVER_CUDA if branch >= first), None)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def find_smi(system: str, which: Callable[[str], Optional[str]] = shutil.which,
             exists: Callable[[str], bool] = os.path.isfile) -> Optional[str]:
    found = which("nvidia-smi")
    if found:
        return found
    return next((p for p in SMI_PLACES.get(system, ()) if exists(p)), None)


def run_smi(exe: str, run=subprocess.run) -> Detection:
    def call(*args):
        r = run([exe, *args], capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
        return r.returncode, (r.stdout or "") + (r.stderr or "")

    try:
        code, header = call()
    except subprocess.TimeoutExpired:
        return Detection("broken", "nvidia-smi", problem=f"nvidia-smi did not answer in {SMI_TIMEOUT_S} s")
    except OSError as e:
        return Detection("broken", "nvidia-smi", problem=f"nvidia-smi cannot run: {e}")
    if code != 0:
        if re.search(r"no devices were found", header, re.I):
            return Detection("none", "nvidia-smi", problem="the driver found no NVIDIA GPU")
        return Detection("broken", "nvidia-smi", problem=_first_line(header) or f"nvidia-smi exit code {code}")
    try:
        qcode, query = call(QUERY, "--format=csv,noheader,nounits")
    except (subprocess.TimeoutExpired, OSError):
        qcode, query = 1, ""
    return parse_smi(header, query if qcode == 0 else "")


def read_nvml(system: str, load=None) -> Detection:
    """The same through NVML (the driver's library), for machines whose nvidia-smi is not found."""
    import ctypes

    names = ["nvml.dll", r"C:\Program Files\NVIDIA Corporation\NVSMI\nvml.dll"] if system == "windows" else [
        "libnvidia-ml.so.1", "/usr/lib/wsl/lib/libnvidia-ml.so.1"]
    lib = None
    for name in names:
        try:
            lib = (load or ctypes.CDLL)(name)
            break
        except OSError:
            continue
    if lib is None:
        return Detection("none", problem="no nvidia-smi and no NVML library: no NVIDIA driver")
    if lib.nvmlInit_v2() != 0:
        return Detection("broken", "nvml", problem="NVML is installed but cannot start (driver not loaded?)")
    try:
        cuda, count = ctypes.c_int(0), ctypes.c_uint(0)
        buf = ctypes.create_string_buffer(96)
        lib.nvmlSystemGetDriverVersion(buf, 96)
        driver = buf.value.decode(errors="replace")
        got_cuda = lib.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(cuda)) == 0 and cuda.value > 0
        lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
        gpus = []
        for i in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(0), ctypes.c_int(0)
            if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
                continue
            lib.nvmlDeviceGetName(handle, buf, 96)
            cc_ok = lib.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) == 0
            gpus.append(Gpu(buf.value.decode(errors="replace"), (major.value, minor.value) if cc_ok else None))
    finally:
        lib.nvmlShutdown()
    ver = (cuda.value // 1000, cuda.value % 1000 // 10) if got_cuda else cuda_for_driver(driver)
    return Detection("gpu" if gpus else "none", "nvml", driver, ver, gpus,
                     problem="" if gpus else "the driver lists no GPU")


def detect(system: str, run=subprocess.run, which=shutil.which, exists=os.path.isfile, nvml=read_nvml) -> Detection:
    if system == "macos":
        return Detection("none", problem="macOS: no CUDA")
    exe = find_smi(system, which, exists)
    if exe is not None:
        return run_smi(exe, run)
    return nvml(system)


# ---- choosing ----------------------------------------------------------------------------------

def choose(system: str, det: Optional[Detection], cpu: bool = False, cuda: Optional[str] = None) -> Choice:
    if cpu:
        return Choice("cpu", "asked for with --cpu", detection=det)
    if cuda is not None:
        want = version(cuda)
        if want is None:
            raise ValueError(f"--cuda {cuda!r} is not a CUDA version like 12.8")
        if system == "macos":
            raise ValueError("torch has no CUDA builds for macOS")
        notes = [] if want in [b[0] for b in CUDA_BUILDS] else [
            f"CUDA {_v(want)} is not one of the builds this installer knows "
            f"({', '.join(_v(b[0]) for b in CUDA_BUILDS)}); trying it anyway"]
        return Choice(backend_name(want), f"asked for with --cuda {_v(want)}", notes, det)
    if system == "macos":
        return Choice("default", "macOS has no CUDA; mlight runs on the CPU there", detection=det)
    if det is None or det.status == "none":
        why = f"no NVIDIA GPU found ({det.problem})" if det and det.problem else "no NVIDIA GPU found"
        return Choice("cpu", why, detection=det)
    if det.status == "broken":
        return Choice("cpu", "the NVIDIA driver did not answer", [
            f"{det.source or 'the driver'} says: {det.problem}",
            "if this machine has an NVIDIA GPU, repair or update its driver (after a driver update, reboot), "
            "then run the installer again, or pick a build yourself with --cuda VERSION"], det)
    return _choose_cuda(det)


def _choose_cuda(det: Detection) -> Choice:
    names = ", ".join(g.name for g in det.gpus)
    ccs = [g.compute for g in det.gpus if g.compute is not None]
    fits = [b for b in CUDA_BUILDS if all(b[1] <= cc <= b[2] for cc in ccs)]
    if ccs and not fits:
        oldest = min(ccs)
        return Choice("cpu", f"{names} (compute {_v(oldest)}) is not supported by torch's CUDA builds",
                      [f"torch's CUDA builds run on compute capability {_v(CUDA_BUILDS[-1][1])} and newer"], det)
    if det.cuda is None:
        return Choice("cpu", f"the driver ({det.driver}) does not say which CUDA it supports",
                      ["pick a build yourself with --cuda VERSION"], det)
    runnable = [b for b in fits if b[0] <= det.cuda]
    if runnable:
        build = runnable[0]
        notes = []
    else:  # a driver older than every build: the same major version still runs it (minor compatibility)
        same_major = [b for b in fits if b[0][0] == det.cuda[0]]
        if not same_major:
            return Choice("cpu", f"the driver {det.driver} supports CUDA {_v(det.cuda)}, older than every torch "
                                 "CUDA build",
                          [f"update the NVIDIA driver to one for CUDA {_v(fits[-1][0])} or newer, then run the "
                           "installer again to use the GPU"], det)
        build = same_major[-1]
        notes = [f"the driver supports CUDA {_v(det.cuda)}; the CUDA {_v(build[0])} build runs on it through CUDA's "
                 "minor-version compatibility, but a driver update is recommended"]
    skipped = [b for b in CUDA_BUILDS if det.cuda >= b[0] > build[0] and b not in fits]
    if skipped:
        notes.append(f"newer CUDA builds ({', '.join(_v(b[0]) for b in skipped)}) are not compiled for "
                     f"compute {_v(min(ccs))}")
    return Choice(backend_name(build[0]), f"{names} on a driver for CUDA {_v(det.cuda)}", notes, det)


# ---- command line ------------------------------------------------------------------------------

def this_system() -> str:
    s = platform.system().lower()
    return {"darwin": "macos"}.get(s, s)


def describe(choice: Choice) -> List[str]:
    lines = []
    det = choice.detection
    if det is not None and det.status == "gpu":
        for g in det.gpus:
            extra = ", ".join(x for x in (f"compute {_v(g.compute)}" if g.compute else "",
                                          f"{g.memory_mib} MiB" if g.memory_mib else "") if x)
            lines.append(f"GPU: {g.name}" + (f" ({extra})" if extra else ""))
        lines.append(f"NVIDIA driver {det.driver}, CUDA {_v(det.cuda) if det.cuda else 'unknown'} (from {det.source})")
    what = {"cpu": "the CPU build", "default": "the default build from the package index"}.get(
        choice.backend, f"the CUDA {choice.backend[2:-1]}.{choice.backend[-1]} build ({choice.backend})")
    lines.append(f"torch: {what}, because: {choice.why}")
    lines += [f"note: {n}" for n in choice.notes]
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="torch_choice.py", description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--cpu", action="store_true", help="the CPU build, even with an NVIDIA GPU")
    g.add_argument("--cuda", metavar="VERSION", help="this CUDA build (e.g. 12.8), whatever the driver says")
    p.add_argument("--system", choices=("linux", "windows", "macos"), default=None,
                   help="decide for this OS instead of the one running (default: $MLIGHT_SYSTEM or this one)")
    p.add_argument("--json", action="store_true", help="print the detection and the choice as JSON")
    a = p.parse_args(argv)
    system = a.system or os.environ.get("MLIGHT_SYSTEM") or this_system()
    det = None if (a.cpu or a.cuda) else detect(system)
    try:
        choice = choose(system, det, cpu=a.cpu, cuda=a.cuda)
    except ValueError as e:
        print(f"torch_choice: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(asdict(choice)))
    else:
        for line in describe(choice):
            print(line, file=sys.stderr)
        print(choice.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
