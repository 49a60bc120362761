"""packaging/torch_choice.py: which torch build the installers pick, from fake nvidia-smi outputs of
several drivers and GPUs, no driver at all, and drivers that fail in the ways they do."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("torch_choice", ROOT / "packaging" / "torch_choice.py")
tc = importlib.util.module_from_spec(_spec)
sys.modules["torch_choice"] = tc  # dataclasses look their module up
_spec.loader.exec_module(tc)

RULE = "+" + "-" * 89 + "+"


def banner(driver: str, cuda: str | None, rows: list[tuple[str, str]]) -> str:
    """nvidia-smi's banner and GPU table, as drivers print them (`mode` is Off/On on Linux, WDDM/TCC on Windows)."""
    cuda_part = f"CUDA Version: {cuda}" if cuda else ""
    lines = ["Mon Nov 30 12:00:00 2026", RULE,
             f"| NVIDIA-SMI {driver}              Driver Version: {driver}      {cuda_part:<20}|",
             "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |", RULE]
    for i, (name, mode) in enumerate(rows):
        lines.append(f"|   {i}  {name:<28}{mode:>6} |   00000000:0{i + 1}:00.0  On |                  N/A |")
        lines.append("|  0%   41C    P8             18W /  350W |     412MiB /  24576MiB |      1%      Default |")
    return "\n".join(lines + [RULE]) + "\n"


def query(*gpus: tuple[str, str, int]) -> str:
    return "".join(f"{n}, {cc}, {mem}\n" for n, cc, mem in gpus)


# name -> (banner output, banner exit code, query output or None when the driver refuses the query)
CASES = {
    "rtx4090-570": (banner("570.86.10", "12.8", [("NVIDIA GeForce RTX 4090", "Off")]), 0,
                    query(("NVIDIA GeForce RTX 4090", "8.9", 24564))),
    "rtx5090-580": (banner("580.65.06", "13.0", [("NVIDIA GeForce RTX 5090", "Off")]), 0,
                    query(("NVIDIA GeForce RTX 5090", "12.0", 32607))),
    "rtx3090-550": (banner("550.54.15", "12.4", [("NVIDIA GeForce RTX 3090", "Off")]), 0,
                    query(("NVIDIA GeForce RTX 3090", "8.6", 24576))),
    "rtx3060-win-566": (banner("566.36", "12.7", [("NVIDIA GeForce RTX 3060", "WDDM")]), 0,
                        query(("NVIDIA GeForce RTX 3060", "8.6", 12288))),
    "gtx1080-580": (banner("580.76.05", "13.0", [("NVIDIA GeForce GTX 1080", "Off")]), 0,
                    query(("NVIDIA GeForce GTX 1080", "6.1", 8192))),
    "t4-535": (banner("535.183.01", "12.2", [("Tesla T4", "Off")]), 0, query(("Tesla T4", "7.5", 15360))),
    "mixed-570": (banner("570.124.04", "12.8", [("NVIDIA GeForce GTX 1080 Ti", "Off"),
                                                ("NVIDIA GeForce RTX 3090", "Off")]), 0,
                  query(("NVIDIA GeForce GTX 1080 Ti", "6.1", 11264), ("NVIDIA GeForce RTX 3090", "8.6", 24576))),
    "old-470": (banner("470.256.02", "11.4", [("NVIDIA GeForce GTX 1070", "Off")]), 0,
                query(("NVIDIA GeForce GTX 1070", "6.1", 8192))),
    "k80-470": (banner("470.256.02", "11.4", [("Tesla K80", "Off")]), 0, query(("Tesla K80", "3.7", 11441))),
    # an older driver that does not know the compute_cap field: GPUs come from the banner's table
    "no-compute-cap-560": (banner("560.35.03", "12.6", [("NVIDIA GeForce RTX 2080", "Off")]), 0, None),
    # a banner without the CUDA field: the driver branch says which CUDA it supports
    "no-cuda-field-575": (banner("575.57.08", None, [("NVIDIA RTX A4000", "Off")]), 0,
                          query(("NVIDIA RTX A4000", "8.6", 16376))),
    "broken-no-driver": ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
                         "that the latest NVIDIA driver is installed and running.\n", 9, None),
    "broken-mismatch": ("Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 570.133\n",
                        18, None),
    "broken-garbage": ("Segmentation fault\n", 0, None),
    "no-devices": ("No devices were found\n", 6, None),
}
EXPECT = {  # case -> (backend, a phrase the explanation must hold)
    "rtx4090-570": ("cu128", "NVIDIA GeForce RTX 4090 on a driver for CUDA 12.8"),
    "rtx5090-580": ("cu130", "CUDA 13.0"),
    "rtx3090-550": ("cu126", "minor-version compatibility"),
    "rtx3060-win-566": ("cu126", "CUDA 12.7"),
    "gtx1080-580": ("cu126", "newer CUDA builds (13.0, 12.8) are not compiled for compute 6.1"),
    "t4-535": ("cu126", "minor-version compatibility"),
    "mixed-570": ("cu126", "compute 6.1"),
    "old-470": ("cpu", "update the NVIDIA driver"),
    "k80-470": ("cpu", "compute 3.7"),
    "no-compute-cap-560": ("cu126", "NVIDIA GeForce RTX 2080"),
    "no-cuda-field-575": ("cu128", "CUDA 12.9"),
    "broken-no-driver": ("cpu", "couldn't communicate with the NVIDIA driver"),
    "broken-mismatch": ("cpu", "Driver/library version mismatch"),
    "broken-garbage": ("cpu", "Segmentation fault"),
    "no-devices": ("cpu", "no NVIDIA GPU found"),
}


class FakeRun:
    """subprocess.run for a fake nvidia-smi: the banner without arguments, CSV for --query-gpu."""

    def __init__(self, case: str):
        self.header, self.code, self.query = CASES[case]
        self.calls = []

    def __call__(self, argv, **kw):
        self.calls.append(argv[1:])
        if len(argv) == 1:
            return subprocess.CompletedProcess(argv, self.code, self.header, "")
        if self.query is None:
            return subprocess.CompletedProcess(argv, 2, "", 'Field "compute_cap" is not a valid field to query.\n')
        return subprocess.CompletedProcess(argv, 0, self.query, "")


def _explain(choice) -> str:
    return "\n".join(tc.describe(choice))


@pytest.mark.parametrize("case", sorted(CASES))
def test_choice_for_each_driver(case):
    system = "windows" if "win" in case else "linux"
    det = tc.detect(system, run=FakeRun(case), which=lambda name: "/usr/bin/nvidia-smi")
    choice = tc.choose(system, det)
    backend, phrase = EXPECT[case]
    assert choice.backend == backend, _explain(choice)
    assert phrase in _explain(choice)


def test_parsed_details():
    det = tc.detect("linux", run=FakeRun("mixed-570"), which=lambda n: "/x/nvidia-smi")
    assert det.status == "gpu" and det.driver == "570.124.04" and det.cuda == (12, 8)
    assert [(g.name, g.compute, g.memory_mib) for g in det.gpus] == [
        ("NVIDIA GeForce GTX 1080 Ti", (6, 1), 11264), ("NVIDIA GeForce RTX 3090", (8, 6), 24576)]
    det = tc.detect("windows", run=FakeRun("rtx3060-win-566"), which=lambda n: None, exists=lambda p: True)
    assert det.gpus[0].name == "NVIDIA GeForce RTX 3060"
    det = tc.detect("linux", run=FakeRun("no-compute-cap-560"), which=lambda n: "/x/nvidia-smi")
    assert [(g.name, g.compute) for g in det.gpus] == [("NVIDIA GeForce RTX 2080", None)]


def test_a_hanging_nvidia_smi_counts_as_broken():
    def hang(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw.get("timeout"))

    det = tc.detect("linux", run=hang, which=lambda n: "/usr/bin/nvidia-smi")
    assert det.status == "broken" and "did not answer" in det.problem
    assert tc.choose("linux", det).backend == "cpu"


def test_nvidia_smi_off_path_is_found_where_drivers_put_it():
    seen = []
    place = tc.find_smi("linux", which=lambda n: None, exists=lambda p: seen.append(p) or "wsl" in p)
    assert place == "/usr/lib/wsl/lib/nvidia-smi"  # WSL 2
    assert tc.find_smi("windows", which=lambda n: None, exists=lambda p: p.endswith("System32\\nvidia-smi.exe"))


def test_no_nvidia_smi_asks_nvml():
    asked = []
    det = tc.detect("linux", which=lambda n: None, exists=lambda p: False,
                    nvml=lambda system: asked.append(system) or tc.Detection("none", problem="no NVML"))
    assert asked == ["linux"] and tc.choose("linux", det).backend == "cpu"


class FakeNvml:
    """The NVML calls read_nvml makes, answering through ctypes pointers as the real library does."""

    def __init__(self, cuda=12080, gpus=(("NVIDIA GeForce RTX 4070", 8, 9),), init=0):
        self.cuda, self.gpus, self.init, self.shut = cuda, gpus, init, False

    def nvmlInit_v2(self):
        return self.init

    def nvmlShutdown(self):
        self.shut = True

    def nvmlSystemGetDriverVersion(self, buf, n):
        buf.value = b"570.86.16"
        return 0

    def nvmlSystemGetCudaDriverVersion_v2(self, ptr):
        ptr._obj.value = self.cuda
        return 0

    def nvmlDeviceGetCount_v2(self, ptr):
        ptr._obj.value = len(self.gpus)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, i, ptr):
        ptr._obj.value = i + 1
        return 0

    def nvmlDeviceGetName(self, handle, buf, n):
        buf.value = self.gpus[handle.value - 1][0].encode()
        return 0

    def nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        _, major._obj.value, minor._obj.value = self.gpus[handle.value - 1]
        return 0


def test_nvml_reading():
    fake = FakeNvml()
    det = tc.read_nvml("linux", load=lambda name: fake)
    assert (det.status, det.source, det.driver, det.cuda) == ("gpu", "nvml", "570.86.16", (12, 8)) and fake.shut
    assert [(g.name, g.compute) for g in det.gpus] == [("NVIDIA GeForce RTX 4070", (8, 9))]
    assert tc.choose("linux", det).backend == "cu128"
    assert tc.read_nvml("linux", load=lambda name: FakeNvml(init=999)).status == "broken"
    assert tc.read_nvml("linux", load=lambda name: FakeNvml(gpus=())).status == "none"

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    assert tc.read_nvml("windows", load=missing).status == "none"


def test_overrides_and_macos():
    det = tc.detect("linux", run=FakeRun("rtx4090-570"), which=lambda n: "/x/nvidia-smi")
    assert tc.choose("linux", det, cpu=True).backend == "cpu"
    assert tc.choose("linux", det, cuda="12.6").backend == "cu126"
    assert tc.choose("windows", None, cuda="cu130").backend == "cu130"
    unknown = tc.choose("linux", None, cuda="12.9")
    assert unknown.backend == "cu129" and "not one of the builds" in unknown.notes[0]
    with pytest.raises(ValueError):
        tc.choose("linux", None, cuda="twelve")
    with pytest.raises(ValueError):
        tc.choose("macos", None, cuda="12.8")
    assert tc.choose("macos", tc.detect("macos")).backend == "default"


# ---- the command line, with a fake nvidia-smi on PATH -------------------------------------------

def fake_smi_dir(tmp_path: Path, case: str) -> Path:
    """A folder holding an executable `nvidia-smi` that answers like the driver in `case`."""
    header, code, q = CASES[case]
    d = tmp_path / f"bin-{case}"
    d.mkdir()
    (d / "case.json").write_text(json.dumps([header, code, q]), encoding="utf-8")
    script = d / "nvidia-smi"
    script.write_text(f"""#!{sys.executable}
import json, sys
header, code, q = json.load(open({str(d / "case.json")!r}, encoding="utf-8"))
if len(sys.argv) == 1:
    sys.stdout.write(header); sys.exit(code)
if q is None:
    sys.stderr.write('Field "compute_cap" is not a valid field to query.\\n'); sys.exit(2)
sys.stdout.write(q)
""", encoding="utf-8")
    script.chmod(0o755)
    return d


def run_cli(args, path_dirs, **env):
    e = dict(os.environ, PATH=os.pathsep.join([str(p) for p in path_dirs] + ["/usr/bin", "/bin"]), **env)
    e.pop("MLIGHT_SYSTEM", None)
    e.update(env)
    return subprocess.run([sys.executable, str(ROOT / "packaging" / "torch_choice.py"), *args], env=e,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(os.name == "nt", reason="a fake nvidia-smi script needs a POSIX shebang")
def test_cli_with_a_fake_nvidia_smi(tmp_path):
    r = run_cli([], [fake_smi_dir(tmp_path, "rtx4090-570")], MLIGHT_SYSTEM="linux")
    assert r.returncode == 0 and r.stdout == "cu128\n", r.stderr
    assert "GPU: NVIDIA GeForce RTX 4090 (compute 8.9, 24564 MiB)" in r.stderr
    r = run_cli(["--json"], [fake_smi_dir(tmp_path, "broken-mismatch")], MLIGHT_SYSTEM="linux")
    out = json.loads(r.stdout)
    assert out["backend"] == "cpu" and out["detection"]["status"] == "broken"
    r = run_cli(["--cuda", "nope"], [], MLIGHT_SYSTEM="linux")
    assert r.returncode == 2 and "not a CUDA version" in r.stderr


def test_runs_on_the_oldest_python_it_claims():
    """Python 3.8 syntax only: the installers run it with whatever Python the machine has."""
    import ast

    tree = ast.parse((ROOT / "packaging" / "torch_choice.py").read_text(encoding="utf-8"), feature_version=(3, 8))
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Match)]
    assert ctypes  # read_nvml's only non-trivial import exists everywhere
