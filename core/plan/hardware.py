"""HardwareSpec: what the planner knows of a machine, from `preset` (datasheets), `detect` (pynvml, psutil) or
`probe` (measured, cached per machine and CPU ISA setting; the only user of torch here).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from core.errors import UsageError
from core.plan.policy import JsonRecord
from core.platform import cache_dir  # noqa: F401  (callers and tests reach it here: core.plan.hardware.cache_dir)
from core.model.device_wait import synchronize  # bounded: a hung probe kernel raises DeviceStalled

GB = 1e9  # vendors quote decimal gigabytes per second
GiB = 1 << 30

# Fields a probe can measure; those listed in HardwareSpec.measured are used as-is by the HRM.
RATE_FIELDS = ("gpu_flops", "gpu_bw", "h2d_bw", "d2h_bw", "cpu_flops", "cpu_bw")


@dataclass(frozen=True)
class HardwareSpec(JsonRecord):
    """One machine. GPU figures are per device; `gpu_count` devices share the host."""

    name: str
    gpu_name: str | None  # None: no usable GPU (CPU-only)
    gpu_count: int
    gpu_mem_bytes: int  # per GPU, total
    gpu_flops: float  # per GPU, dense fp16/bf16 tensor peak, FLOP/s
    gpu_bw: float  # per GPU, device memory bandwidth, bytes/s
    h2d_bw: float  # host→device link per GPU, bytes/s, one direction
    d2h_bw: float  # device→host link per GPU, bytes/s
    cpu_flops: float  # all cores, fp32 FLOP/s (the per-dtype rates are in cpu_matmul)
    cpu_bw: float  # host memory read bandwidth, bytes/s
    cpu_mem_bytes: int
    cpu_cores: int
    gpu_mem_free_bytes: int | None = None  # detect only: what other processes leave us
    cpu_mem_available_bytes: int | None = None
    pcie: str | None = None  # e.g. "gen3 x16"
    host_link_bw: float | None = None  # all GPUs' host↔device traffic together (the PCIe root complex), bytes/s; None: each GPU's link is its own
    source: str = "preset"  # "preset" | "detect" | "probe"
    measured: tuple[str, ...] = ()  # RATE_FIELDS that were measured here rather than read off a datasheet
    # the CPU's instruction set as torch may use it (core.model.cpu.isa), the CPU's own, the settings lowering it
    cpu_isa: str | None = None
    cpu_isa_hw: str | None = None
    cpu_isa_limits: tuple[str, ...] = ()
    cpu_matmul: dict = dataclasses.field(default_factory=dict)  # measured matmul FLOP/s, all cores, by dtype/kernel
    cpu_threads: int | None = None  # threads the CPU rates were measured with
    # `mlight bench --calibrate`'s CPU cost models: {math dtype: {model key: core.plan.cpu_cost.CpuCosts dict}}
    cpu_costs: dict = dataclasses.field(default_factory=dict)
    # kept empty, for hardware files and `mlight plan --json`: calibrations carry no speed stamp to scale to
    cpu_speed: dict = dataclasses.field(default_factory=dict)
    # the GPU executor's host seconds per task and per op, measured (None: hrm.TASK_SECONDS / OP_SECONDS)
    host_task_seconds: float | None = None
    host_op_seconds: float | None = None
    # page-locking host memory (cudaHostRegister), bytes/s, as gpu_check measured it here (None: hrm.PIN_BW)
    pin_bw: float | None = None
    # the GPU's compute capability (a T4 is (7, 5)): which expert kernels the runtime can run (hrm.expert_path)
    gpu_capability: tuple = ()

    def __post_init__(self):
        if self.gpu_count < 0 or self.cpu_cores <= 0:
            raise ValueError(f"gpu_count must be >= 0 and cpu_cores > 0, got {self.gpu_count}, {self.cpu_cores}")
        if (self.gpu_count == 0) != (self.gpu_name is None):
            raise ValueError("gpu_name must be None exactly when gpu_count is 0")
        if self.cpu_mem_bytes <= 0 or self.cpu_flops <= 0 or self.cpu_bw <= 0:
            raise ValueError("cpu_mem_bytes, cpu_flops and cpu_bw must be positive")
        if self.gpu_count:
            for f in ("gpu_mem_bytes", "gpu_flops", "gpu_bw", "h2d_bw", "d2h_bw"):
                if getattr(self, f) <= 0:
                    raise ValueError(f"HardwareSpec.{f} must be positive on a machine with a GPU")
        unknown = set(self.measured) - set(RATE_FIELDS)
        if unknown:
            raise ValueError(f"measured names unknown fields {sorted(unknown)}; expected some of {RATE_FIELDS}")
        for name in ("measured", "cpu_isa_limits", "gpu_capability"):  # JSON gives lists
            object.__setattr__(self, name, tuple(getattr(self, name) or ()))
        for name in ("cpu_matmul", "cpu_speed"):
            object.__setattr__(self, name, {str(k): float(v) for k, v in dict(getattr(self, name)).items()})
        object.__setattr__(self, "cpu_costs", {str(k): {str(m): dict(c) for m, c in dict(v).items()}
                                               for k, v in dict(self.cpu_costs).items()})

    def cpu_rate(self, dtype: str) -> float | None:
        return self.cpu_matmul.get(dtype) or None  # floats since __post_init__

    def cpu_math(self, storage: str) -> tuple[str, str]:
        """(dtype the CPU computes in, why) for weights stored in `storage`: the engine's rule
        (core.model.cpu.compute). An unknown ISA (an old probe's file) is taken to run the storage dtype natively."""
        from core.model.cpu.compute import math_for, native

        if self.cpu_isa is None:
            return math_for(storage, self.cpu_matmul, True, "an unknown CPU")
        return math_for(storage, self.cpu_matmul, native(storage, self._isa()), self.cpu_isa_text())

    def cpu_flops_for(self, storage: str) -> tuple[float, str, bool]:
        math, _ = self.cpu_math(storage)
        rate = self.cpu_rate(math)
        return (rate, math, True) if rate else (self.cpu_flops, math, "cpu_flops" in self.measured)

    def _isa(self):
        from core.model.cpu.isa import CpuIsa

        return CpuIsa(self.cpu_isa_hw or self.cpu_isa, self.cpu_isa, self.cpu_isa in ("avx512_bf16", "amx"),
                      self.cpu_isa == "amx", self.cpu_isa_limits)

    def cpu_isa_text(self, name_up_to: int | None = None) -> str:
        """e.g. "AVX2 (CPU has AVX-512 BF16; limited by ONEDNN_MAX_CPU_ISA=AVX2)"; "unknown" before a probe."""
        return self._isa().describe(name_up_to) if self.cpu_isa else "unknown"

    @property
    def has_gpu(self) -> bool:
        return self.gpu_count > 0

    def with_link(self, gbps: float) -> "HardwareSpec":
        if gbps <= 0:
            raise UsageError(f"--pcie-gbps must be positive, got {gbps}", "give the link bandwidth in GB/s, e.g. 16")
        measured = tuple(m for m in self.measured if m not in ("h2d_bw", "d2h_bw"))
        return dataclasses.replace(self, h2d_bw=gbps * GB, d2h_bw=gbps * GB, measured=measured)


# PCIe, one direction, after 128b/130b encoding: gen3 x16 15.75 GB/s, gen4 31.5, gen5 63 (PCI-SIG).
_PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

# name: (marketing name, memory GiB, dense fp16/bf16 tensor TFLOP/s, memory GB/s, pcie gen, width, compute
# capability), from NVIDIA's datasheets and whitepapers (fp16 with fp32 accumulate where they differ) and its
# CUDA GPUs table. L4's sheet says 242 TFLOPS with sparsity; AWS publishes no A10G sheet: 70 is the figure quoted
# for its lower clocks (the A10's sheet: 125).
_GPUS = {
    "t4": ("Tesla T4", 16, 65.0, 320.0, 3, 16, (7, 5)),
    "l4": ("NVIDIA L4", 24, 121.0, 300.0, 4, 16, (8, 9)),
    "a10g": ("NVIDIA A10G", 24, 70.0, 600.0, 4, 16, (8, 6)),
    "rtx3090": ("NVIDIA GeForce RTX 3090", 24, 71.0, 936.0, 4, 16, (8, 6)),
    "rtx4090": ("NVIDIA GeForce RTX 4090", 24, 165.2, 1008.0, 4, 16, (8, 9)),
    "a100-80g": ("NVIDIA A100 80GB PCIe", 80, 312.0, 1935.0, 4, 16, (8, 0)),
    "h100": ("NVIDIA H100 80GB HBM3", 80, 989.0, 3350.0, 5, 16, (9, 0)),
}

# The paper's CPU hosts (MoE-Lightning §6): S1/S2 24 cores, 192 GB, ≈76–100 GB/s (we take 90); S6–S9 (2×/4× T4)
# 32 cores, 416 GB; Xeons at AVX-512 ≈2.2 GHz, one FMA unit → ≈70 GFLOP/s a core. The paper assumes a 16 GB/s
# link everywhere (its own L4 KV copies imply ≈12.3 GB/s), so the host caps the GPU's link there: --pcie-gbps.
_HOSTS = {
    1: dict(cpu_cores=24, cpu_mem_bytes=192 * 10**9, cpu_bw=90.0 * GB, cpu_flops=24 * 70e9, link_gbps=16.0),
    2: dict(cpu_cores=32, cpu_mem_bytes=416 * 10**9, cpu_bw=100.0 * GB, cpu_flops=32 * 70e9, link_gbps=16.0),
}


def preset(name: str) -> HardwareSpec:
    """A named machine: "t4" (one T4 in the paper's 24-core/192 GB host), "2xt4", "4xt4", ..."""
    key = name.strip().lower().replace("_", "-")
    c, x, rest = key.partition("x")
    count, gpu = (int(c), rest) if x and c.isdigit() else (1, key)
    if gpu not in _GPUS or count < 1:
        raise UsageError(f"unknown hardware preset {name!r}",
                         f"use one of {', '.join(_GPUS)} (optionally as 2x<gpu> or 4x<gpu>) or 'local'")
    full, mem_gib, tflops, gbps, gen, width, capability = _GPUS[gpu]
    host = _HOSTS[1 if count == 1 else 2]
    link = min(_PCIE_GBPS_PER_LANE[gen] * width, host["link_gbps"]) * GB
    return HardwareSpec(
        name=key, gpu_name=full, gpu_count=count, gpu_mem_bytes=mem_gib * GiB,
        gpu_flops=tflops * 1e12, gpu_bw=gbps * GB, h2d_bw=link, d2h_bw=link,
        cpu_flops=host["cpu_flops"], cpu_bw=host["cpu_bw"], cpu_mem_bytes=host["cpu_mem_bytes"],
        cpu_cores=host["cpu_cores"], pcie=f"gen{gen} x{width}", source="preset", cpu_isa="avx512",
        gpu_capability=capability,
    )


def _match_gpu(name: str) -> str | None:
    """The preset key whose GPU the NVML name refers to, e.g. "Tesla T4" → "t4"."""
    n = name.lower().replace("-", " ")
    for key, (full, *_rest) in _GPUS.items():
        bare = key.replace("rtx", "rtx ").replace("-80g", "")
        if full.lower() in n or f" {bare} " in f" {n} " or n.endswith(" " + bare):
            return key
    return None


def gpu_compute_dtype(dtype, capability: tuple[int, int] | None):
    """The dtype a GPU computes a `dtype` checkpoint in: before SM80 bf16 is emulated, many times slower, so fp16
    (the engine checks the range)."""
    import torch

    if dtype == torch.bfloat16 and capability is not None and tuple(capability) < (8, 0):
        return torch.float16
    return dtype


def detect() -> HardwareSpec:
    import psutil

    cores = psutil.cpu_count(logical=False) or psutil.cpu_count() or 1
    vm = psutil.virtual_memory()
    # guesses until a probe measures: AVX2 at ≈2.5 GHz a core; ≈10 GB/s a core, capped at a server's 204 GB/s
    cpu_flops, cpu_bw = cores * 80e9, min(cores * 10.0, 204.0) * GB
    gpus = nvml_gpus()
    base = dict(cpu_flops=cpu_flops, cpu_bw=cpu_bw, cpu_mem_bytes=int(vm.total), cpu_cores=int(cores),
                cpu_mem_available_bytes=int(vm.available), source="detect")
    if not gpus:
        return HardwareSpec(name="local", gpu_name=None, gpu_count=0, gpu_mem_bytes=0, gpu_flops=0.0, gpu_bw=0.0,
                            h2d_bw=0.0, d2h_bw=0.0, **base)
    g = gpus[0]  # planning assumes identical GPUs; the first one speaks for all
    key = _match_gpu(g["name"])
    if key:
        _full, _mem, tflops, gbps, _gen, _width, capability = _GPUS[key]
        flops, bw = tflops * 1e12, gbps * GB
    else:  # unknown GPU: bandwidth from NVML clocks, compute a conservative guess until probed
        flops, bw, capability = 30e12, g.get("mem_bw") or 300 * GB, ()
    gen, width = g.get("pcie_gen") or 3, g.get("pcie_width") or 16
    link = _PCIE_GBPS_PER_LANE.get(gen, 0.985) * width * GB
    return HardwareSpec(
        name="local", gpu_name=g["name"], gpu_count=len(gpus), gpu_mem_bytes=g["mem_total"],
        gpu_mem_free_bytes=min(x["mem_free"] for x in gpus), gpu_flops=flops, gpu_bw=bw, h2d_bw=link, d2h_bw=link,
        pcie=f"gen{gen} x{width}", gpu_capability=capability, **base,
    )


def nvml_gpus() -> list[dict]:
    """One dict per GPU, or [] when NVML (library, driver or device) is not there."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver, no device: the CPU-only case
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            d = {"name": name, "mem_total": int(mem.total), "mem_free": int(mem.free), "pcie_gen": None,
                 "pcie_width": None, "mem_bw": None}
            # older drivers lack these queries: detect falls back to gen3 x16 and a guessed bandwidth
            for key, fn in (("pcie_gen", "nvmlDeviceGetMaxPcieLinkGeneration"),
                            ("pcie_width", "nvmlDeviceGetMaxPcieLinkWidth")):
                with suppress(Exception):
                    d[key] = int(getattr(pynvml, fn)(h))
            with suppress(Exception):
                bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(h)
                mhz = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
                d["mem_bw"] = bus_bits / 8 * mhz * 1e6 * 2  # double data rate
            out.append(d)
        return out
    except Exception:
        return []
    finally:
        with suppress(Exception):
            pynvml.nvmlShutdown()


def machine_key(hw: HardwareSpec) -> str:
    """This machine, and the ISA limits in its environment (they change the CPU's rates)."""
    from core.model.cpu.isa import ENV_LIMITS

    # the first two always, the later ones only when set: keys (and calibrations) made before them stay valid
    limits = "|".join(f"{k}={os.environ.get(k, '')}" for k in ENV_LIMITS if k in ENV_LIMITS[:2] or os.environ.get(k))
    ident = (f"{platform.node()}|{platform.processor()}|{hw.cpu_cores}|{hw.cpu_mem_bytes}|{hw.gpu_name}|"
             f"{hw.gpu_count}|{limits}")
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


PROBE_VERSION = 2  # bump when the probe measures something new: older cache entries are measured again


def probe_cache_path(hw: HardwareSpec) -> Path:
    return cache_dir() / "probe" / f"v{PROBE_VERSION}-{machine_key(hw)}.json"


def probe(base: HardwareSpec | None = None, *, refresh: bool = False, seconds: float = 0.25,
          measure=None) -> HardwareSpec:
    """Detected hardware with measured rates (cached unless `refresh`) and its calibrated CPU costs.
    `measure(hw, seconds) -> {field: value}`: RATE_FIELDS and _CPU_EXTRA (default `_measure`; tests pass a stub)."""
    hw = base or detect()
    cached = None if refresh else cached_probe(hw)  # a damaged cache entry is measured again and overwritten
    if cached is not None:
        return cached
    rates = (measure or _measure)(hw, seconds)
    _write_json(probe_cache_path(hw), {"rates": rates, "time": time.time(), "machine": hw.to_dict()})
    return _probed(hw, rates)


def cached_probe(base: HardwareSpec | None = None) -> HardwareSpec | None:
    """None when never probed (measures nothing)."""
    hw = base or detect()
    try:
        rates = json.loads(probe_cache_path(hw).read_text(encoding="utf-8"))["rates"]
        return _probed(hw, rates)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _probed(hw: HardwareSpec, rates: dict) -> HardwareSpec:
    from core.plan import cpu_cost

    hw = _apply(hw, rates)
    gpu = _gpu_costs(hw) if hw.has_gpu else {}
    return dataclasses.replace(hw, cpu_costs=cpu_cost.load(hw) or hw.cpu_costs, **gpu)


# What bench/gpu_check.py measured of this machine's GPU path, in a file of their own (a new probe keeps them);
# the HRM uses them in place of its H200 figures.
GPU_COSTS = ("host_task_seconds", "host_op_seconds", "pin_bw")


def gpu_costs_path(hw: HardwareSpec) -> Path:
    return cache_dir() / "probe" / f"gpu-costs-{machine_key(hw)}.json"


def _gpu_costs(hw: HardwareSpec) -> dict[str, float]:
    try:
        kept = json.loads(gpu_costs_path(hw).read_text(encoding="utf-8"))["costs"]
        return {k: float(kept[k]) for k in GPU_COSTS if kept.get(k, 0) > 0}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def record_gpu_costs(hw: HardwareSpec, **values: float) -> Path:
    """Keep measured GPU-path costs (GPU_COSTS); earlier ones not given stay."""
    unknown = set(values) - set(GPU_COSTS)
    if unknown:
        raise ValueError(f"unknown GPU costs {sorted(unknown)}; expected some of {GPU_COSTS}")
    kept = {**_gpu_costs(hw), **{k: float(v) for k, v in values.items() if v and v > 0}}
    _write_json(gpu_costs_path(hw), {"costs": kept, "time": time.time()})
    return gpu_costs_path(hw)


def cached_cpu_rates() -> dict[str, float] | None:
    hw = cached_probe()
    return dict(hw.cpu_matmul) if hw is not None and hw.cpu_matmul else None


_CPU_EXTRA = ("cpu_isa", "cpu_isa_hw", "cpu_isa_limits", "cpu_matmul", "cpu_threads")


def _apply(hw: HardwareSpec, rates: dict) -> HardwareSpec:
    extra = {k: rates[k] for k in _CPU_EXTRA if rates.get(k) is not None}
    rates = {k: float(v) for k, v in rates.items() if k in RATE_FIELDS and v and v > 0}
    if not hw.has_gpu:
        rates = {k: v for k, v in rates.items() if k.startswith("cpu")}
    measured = tuple(sorted(set(hw.measured) | set(rates)))
    return dataclasses.replace(hw, **rates, **extra, measured=measured, source="probe")


def _write_json(path: Path, data: dict) -> None:
    from core.platform import write_whole  # ranks probing at once each rename their own file

    write_whole(path, json.dumps(data, indent=1))


# this process's CPU seconds where the clock resolves a probe's runs (not Windows' 15.6 ms process times)
_CPU_CLOCK = time.get_clock_info("process_time").resolution <= 1e-4


def bandwidth_probe_bytes(llc: int | None = None, available: int | None = None) -> int:
    """The buffer the memory-read probe sums: twice the last-level cache (so it misses), at least 256 MiB (stacked
    caches hold 96-128 MB), at most an eighth of the free memory."""
    import psutil

    from core.platform import llc_bytes

    llc = llc_bytes() if llc is None else llc
    available = psutil.virtual_memory().available if available is None else available
    return max(64 * 2**20, min(max(256 * 2**20, 2 * (llc or 0)), available // 8))


def _best(fn, seconds: float) -> float:
    """Fastest of repeated runs of `fn` within about `seconds`, each timed by the lesser of the wall clock and the
    process's CPU seconds: on shared cores the wall clock counts others' turns, and CPU time never flatters."""
    best, end = float("inf"), time.perf_counter() + seconds
    fn()  # warm-up
    while True:
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        best = min(best, min(wall, cpu) if _CPU_CLOCK and cpu > 0 else wall)
        if time.perf_counter() > end:
            return best


def _matmul_rate(dtype_name: str):
    """Square matmuls grown until one takes ≥ 20 ms (a slow dtype stays small)."""

    def run(seconds: float) -> float:
        import torch

        dt = getattr(torch, dtype_name)
        n = 256
        while True:
            a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
            t = _best(lambda: torch.mm(a, b), 0.0)
            if t >= 0.02 or n >= 2048:
                return 2 * n**3 / min(t, _best(lambda: torch.mm(a, b), seconds))
            n *= 2

    return run


# CPU matmul kernels the probe measures, by HardwareSpec.cpu_matmul's names: a time budget -> FLOP/s.
CPU_MATMUL_PROBES = {name: _matmul_rate(name) for name in ("float32", "bfloat16", "float16")}


def _quant_rate(name: str, rows: int, seconds: float) -> float:
    """torch's weight-only CPU kernel (int8, int4) at `rows` rows, as the engine runs it (kernel_probe)."""
    from core.model.quant.experts import kernel_probe

    fn, flops = kernel_probe(name, rows=rows)
    return flops / _best(fn, seconds)


# "int4": at 64 rows (FLOP-bound); "int4@1": one row, where expanding each weight is the cost
CPU_MATMUL_PROBES.update({f"{name}{suffix}": functools.partial(_quant_rate, name, rows) for name in ("int8", "int4")
                          for suffix, rows in (("", 64), ("@1", 1))})


def _measure(hw: HardwareSpec, seconds: float) -> dict:
    import torch

    from core.model.cpu.isa import cpu_isa
    from core.platform import free_cores

    isa = cpu_isa()
    before = torch.get_num_threads()
    threads = free_cores()  # a core busy elsewhere would stall every OpenMP barrier of the measurement
    torch.set_num_threads(threads)
    try:
        rates = {"cpu_isa": isa.usable, "cpu_isa_hw": isa.hardware, "cpu_isa_limits": list(isa.limited_by),
                 "cpu_threads": threads}
        matmul = {}
        for name, measure_one in CPU_MATMUL_PROBES.items():
            try:
                matmul[name] = measure_one(seconds)
            except (RuntimeError, TypeError, AttributeError):  # a kernel this torch or CPU lacks: not measured
                continue
        rates["cpu_matmul"] = matmul
        rates["cpu_flops"] = matmul.get("float32") or _matmul_rate("float32")(seconds)
        big = torch.ones(bandwidth_probe_bytes() // 4)
        rates["cpu_bw"] = big.numel() * 4 / _best(lambda: big.sum(), seconds)
        del big
    finally:
        torch.set_num_threads(before)
    if hw.has_gpu and torch.cuda.is_available():
        try:
            rates.update(_gpu_rates(torch, seconds))
        finally:  # the app loads the engine in this process next, and it plans by the memory it sees free
            _release_cached(torch)
    return rates


def _gpu_rates(torch, seconds: float) -> dict:
    rates = {}
    dev = torch.device("cuda")

    def timed(fn):
        def run():
            fn()
            synchronize("the GPU probe's timed work")
        return _best(run, seconds)

    n = 4096
    # the dtype a bf16 checkpoint actually computes in on this GPU (fp16 where bf16 is not native)
    dt = gpu_compute_dtype(torch.bfloat16, torch.cuda.get_device_capability(dev))
    ga, gb = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
    rates["gpu_flops"] = 2 * n**3 / timed(lambda: torch.mm(ga, gb))
    gbuf = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    gdst = torch.empty_like(gbuf)
    rates["gpu_bw"] = 2 * gbuf.numel() / timed(lambda: gdst.copy_(gbuf))  # a copy reads and writes
    try:
        host = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:  # pinning refused (e.g. Windows caps it): measure pageable copies
        host = torch.empty(256 * 2**20, dtype=torch.uint8)
    rates["h2d_bw"] = host.numel() / timed(lambda: gbuf.copy_(host, non_blocking=True))
    rates["d2h_bw"] = host.numel() / timed(lambda: host.copy_(gbuf, non_blocking=True))
    return rates


def _release_cached(torch) -> None:
    """Hand the probe's freed blocks back (torch's device and host caches), or the engine keeps fewer experts
    resident for memory it no longer sees free."""
    synchronize("the GPU probe's last copies")  # they are done with the buffers
    torch.cuda.empty_cache()
    empty_host = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) \
        or getattr(torch._C, "_host_emptyCache", None)  # the public name is newer than some supported torch
    if empty_host is not None:
        empty_host()


def resolve(name: str, *, pcie_gbps: float | None = None) -> HardwareSpec:
    """`--hardware NAME`: "local" (detect, then the cached probe), a preset, or a `mlight hw --json` file."""
    if name.strip().lower() == "local":
        hw = probe(detect())
    elif name.lower().endswith(".json"):
        path = Path(name).expanduser()
        try:
            hw = HardwareSpec.from_json(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise UsageError(f"cannot read hardware file {path}: {e}", "give a file written by `mlight hw --json`") from e
        except (ValueError, TypeError) as e:
            raise UsageError(f"{path} is not a hardware description: {e}",
                             "give a file written by `mlight hw --json`") from e
    else:
        hw = preset(name)
    return hw.with_link(pcie_gbps) if pcie_gbps is not None else hw
