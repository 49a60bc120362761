"""Fused decode attention in C (core/assets/kernels/decode_attention.c), and the build all mlight's C kernels share:
torch's bf16 `bmm` runs decode attention (a GEMV per request and KV head) at a third of the memory bandwidth,
after copying the rows out; the kernel reads K and V once each in the cache's layout, with fp32 scores and sums.
Where it cannot run, `usable` says False and torch's ops do. Requests are split over the calling thread's own
helpers, so the GPU schedules' pinned attention worker keeps its cores; ctypes releases the GIL in a call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from core import platform
from core.assets import DECODE_ATTENTION_C as SOURCE
from core.errors import UsageError
from core.model import kernels
from core.model.cpu import isa

DTYPES = (torch.bfloat16, torch.float32)
MAX_G, MAX_D = 16, 256
HELPER_IDLE_S = 2.0  # how often an idle helper checks that the thread it serves still runs

_announce = None  # set by Kernel.prepare while a kernel loads: called when a compile starts (any kernel)


def status() -> str:
    """One line for `mlight hw` and the bench: which decode attention runs, and why."""
    lib = library()
    return f"fused C kernel ({lib.flags})" if lib is not None else f"torch ops ({KERNEL.reason})"


def _flags() -> tuple[list[str], int]:
    """(compiler flags, floats per vector) for the ISA our kernels may use here."""
    if isa.X86:
        i = isa.cpu_isa()
        if i.at_least("avx512"):
            return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"], 16
        if i.at_least("avx2"):
            return ["-mavx2", "-mfma"], 8
    return [], 4  # SSE2 / NEON: 128-bit vectors


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


STRICT_ENV = "MLIGHT_STRICT_KERNEL_CALLS"  # 1 (the tests set it): every C kernel call checks its argument count


def bind(dll, name: str, argtypes: list, restype):
    """`dll`'s function `name` typed. ctypes passes extra arguments through unchecked, so under STRICT_ENV each
    call checks its count; elsewhere the bare function runs (nothing added to a decode step's calls)."""
    fn = getattr(dll, name)
    fn.argtypes, fn.restype = argtypes, restype
    if os.environ.get(STRICT_ENV) != "1":
        return fn
    n = len(argtypes)

    def strict(*args):
        if len(args) != n:
            raise TypeError(f"{name} takes {n} arguments, got {len(args)}")
        return fn(*args)

    strict.__wrapped__ = fn  # the C function itself, for one_stream's table of calls
    return strict


class Library:
    """A C kernel's library: `openmp`, whether its build has OpenMP (C function `openmp_fn`), `flags` for status."""

    def __init__(self, path, flags: str, openmp_fn: str):
        self.dll = ctypes.CDLL(str(path))
        self.openmp = bool(getattr(self.dll, openmp_fn)())
        self.flags = flags + (" -fopenmp" if self.openmp else "")
        self._sizes: dict[tuple, int] = {}

    def sized(self, fn: str, *shape: int) -> int:
        """Function `fn`'s scratch size for this call shape, asked once: a ctypes call costs µs, cold after the
        experts stream, and a decode step calls the expert kernels three times a layer."""
        key = (fn, *shape)
        n = self._sizes.get(key)
        if n is None:
            n = self._sizes[key] = getattr(self, fn)(*shape)
        return n


def runs(lib: Library | None) -> bool:
    """Whether a built kernel runs here: with OpenMP, or where torch runs one thread (one C thread loses to many)."""
    return lib is not None and (lib.openmp or torch.get_num_threads() == 1)


class _Lib(Library):
    def __init__(self, path: Path, flags: str):
        super().__init__(path, flags, "mlight_decode_attention_openmp")
        P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        C = ctypes.c_int
        self.fn = bind(self.dll, "mlight_decode_attention", [P, C, I, P, P, C, P, P, I, I, I, I, I, I, I, F, P, C, P, I], C)
        self.parts = bind(self.dll, "mlight_decode_attention_parts", [P, C, I, P, P, C, P, P, P, C, I, I, I, I, I, F, P, C, P, I], C)


class Kernel:
    """One C kernel's library, built by `build(*key)` -> (library or None, why not) once per `key()` (the usable
    ISA level, and whatever else picks the flags); `what` is said while it compiles (`prepare`)."""

    made: list[Kernel] = []  # every kernel, for core.model.kernels.forget_builds

    def __init__(self, what: str, build, key=lambda: (isa.cpu_isa().usable,)):
        self.what, self._build, self._key = what, build, key
        self.reason = "not built yet"
        self.built: dict[tuple, Library | None] = {}
        Kernel.made.append(self)

    def at(self, *key):
        if key not in self.built:
            self.built[key], self.reason = self._build(*key)
        return self.built[key]

    def library(self):
        return self.at(*self._key())

    def cache_clear(self) -> None:
        self.built.clear()

    def prepare(self, progress=None) -> None:
        """Build now, not inside the first decode step; a compile this starts tells `progress` (a core.telemetry
        sink, or None) `what` is being built, and when it is."""
        from core.telemetry import Progress

        global _announce
        built = []

        def announce() -> None:
            built.append(True)
            if progress is not None:
                progress(Progress(self.what, 0, 1))

        _announce = announce
        try:
            self.library()
        finally:
            _announce = None
        if built and progress is not None:
            progress(Progress(self.what, 1, 1))


def _build(level: str):
    flags, vw = _flags()
    return build_kernel(SOURCE, "decode_attention", [f"-DVW={vw}", *flags], vw,
                        lambda path: _Lib(path, " ".join(flags) or "baseline"),
                        vw_of=lambda lib: lib.dll.mlight_decode_attention_vw())


def build_kernel(source: Path, name: str, flags: list[str], vw: int, make, switches=("MLIGHT_NATIVE",),
                 vw_of=None):
    """(`make(path)`: the ctypes wrapper of `source` built with `flags` or cached, "") or (None, why not): a
    switch at 0, no compiler, a failed build or load, or a cached library of another vector width (`vw_of`)."""
    off = kernels.switched_off(switches)
    if off:
        return None, off
    cc = _compiler()
    if cc is None:
        return _failed(name, "no C compiler found (cc, gcc, clang or $CC)")
    out = compile_openmp(cc, ["-O3", "-shared", "-fPIC", *flags], source, name)
    if isinstance(out, str):
        return _failed(name, out)
    try:
        lib = make(out)
    except (OSError, AttributeError) as e:
        return _failed(name, f"could not load the kernel: {e}")
    if vw_of is not None and vw_of(lib) != vw:
        return _failed(name, "the kernel in the cache was built for another vector width")
    return lib, ""


def _failed(name: str, why: str):
    """(None, why) — or, under MLIGHT_KERNELS=native, the error: the kernels were asked for, not a fallback."""
    if kernels.mode() == "native":
        raise UsageError(f"the C kernel {name} cannot run here ({why}) and {kernels.ENV}=native asks for it",
                         f"install a C compiler (gcc or clang), or set {kernels.ENV}=auto to fall back to torch")
    return None, why


def compile_openmp(cc: str, base: list[str], source: Path, name: str) -> Path | str:
    """`_compile` with OpenMP where torch runs on libgomp (the kernel then shares torch's threads); else, or where
    that fails, without."""
    out = "no build tried"
    for args in ([*base, "-fopenmp"], base) if _torch_uses_gomp() else (base,):
        out = _compile(cc, args, source, name)
        if not isinstance(out, str):
            break
    return out


def _compile(cc: str, args: list[str], source: Path, name: str) -> Path | str:
    """The library of `source` built with `args` in the cache dir (built now, after `_announce`), or why not."""
    tag = hashlib.sha256(source.read_bytes() + " ".join([cc, *args]).encode()).hexdigest()[:16]
    suffix = ".dll" if platform.is_windows() else ".so"
    out = platform.cache_dir() / "kernels" / f"{name}-{tag}{suffix}"
    if out.is_file():
        return out
    if _announce is not None:
        _announce()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=suffix, dir=out.parent)
        os.close(fd)
        r = subprocess.run([cc, *args, "-o", tmp, str(source)], capture_output=True, text=True, encoding="utf-8",
                           errors="replace", timeout=120)
        if r.returncode != 0:
            platform.remove(tmp)
            return f"the C compiler failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}"
        platform.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not build the kernel: {e}"
    return out


def _torch_uses_gomp() -> bool:
    """Whether torch's CPU threads are GNU OpenMP's (a libgomp.so.1 in its lib folder, Linux wheels)."""
    return platform.SYSTEM == "linux" and (Path(torch.__spec__.origin).parent / "lib" / "libgomp.so.1").is_file()


KERNEL = Kernel("building the CPU decode attention kernel (once per machine)", _build)
library, prepare = KERNEL.library, KERNEL.prepare


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks) -> bool:
    """Whether the kernel takes this call (CPU bf16/fp32, K and V alike with contiguous rows, G and D in range)."""
    if sinks is not None or q.device.type != "cpu" or k.device.type != "cpu":
        return False
    if q.dtype not in DTYPES or k.dtype not in DTYPES or v.dtype != k.dtype or k.dim() != 4:
        return False
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    if v.shape[-1] != D or k.shape[-1] != D or Hq % Hkv or Hq // Hkv > MAX_G or D > MAX_D:
        return False
    if k.stride() != v.stride() or k.stride(3) != 1 or k.stride(2) != D or q.stride(2) != 1 or q.stride(1) != D:
        return False
    return library() is not None


class _Pool:
    """Helper threads of one calling thread, each running one slice of a call's requests."""

    def __init__(self, n: int):
        self.n = n
        self.owner = threading.current_thread()
        self.jobs = [queue.SimpleQueue() for _ in range(n - 1)]
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.scratch = [torch.empty(0) for _ in range(n)]
        for j in range(n - 1):
            threading.Thread(target=self._serve, args=(j,), name=f"mlight-attn-{j + 1}", daemon=True).start()

    def _serve(self, j: int) -> None:
        """Run jobs until told to stop (None) or the thread that made this pool has ended."""
        while True:
            try:
                job = self.jobs[j].get(timeout=HELPER_IDLE_S)
            except queue.Empty:
                if self.owner.is_alive():
                    continue
                return
            if job is None:
                return
            try:
                job()
            finally:
                self.done.put(None)

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)

    def run(self, jobs) -> None:
        for j, job in enumerate(jobs[1:]):
            self.jobs[j].put(job)
        jobs[0]()
        for _ in jobs[1:]:
            self.done.get()

    def buffer(self, j: int, numel: int) -> torch.Tensor:
        if self.scratch[j].numel() < numel:
            self.scratch[j] = torch.empty(numel)
        return self.scratch[j]


_local = threading.local()


def scratch(nbytes: int) -> torch.Tensor:
    """This thread's scratch for every C kernel, grown once to the largest call, then reused (none per step)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.buf = torch.empty(nbytes, dtype=torch.uint8)
    return buf


def _pool(n: int) -> _Pool:
    p = getattr(_local, "pool", None)
    if p is None or p.n != n:  # the thread count moved (threads.Governor)
        if p is not None:
            p.close()
        p = _local.pool = _Pool(n)
    return p


def cuts(lengths: list[int], parts: int) -> list[int]:
    """Request boundaries splitting `lengths` into `parts` runs of about equal Σ length."""
    total = sum(lengths) or 1
    out, acc, j = [0], 0, 1
    for i, n in enumerate(lengths):
        acc += n
        while j < parts and acc >= total * j / parts:
            out.append(i + 1)
            j += 1
    while len(out) < parts:
        out.append(len(lengths))
    out.append(len(lengths))
    return out


def moe_inputs(ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor):
    """A fused experts call's tensors as the C side reads them: int64 ids, fp32 or bf16 weights, each contiguous."""
    if weights.dtype not in (torch.float32, torch.bfloat16):
        weights = weights.float()
    if ids.dtype != torch.int64:
        ids = ids.long()
    return tuple(t if t.is_contiguous() else t.contiguous() for t in (ids, weights, x))


_bounds = threading.local()


def _bounds_tensor(bounds: list[int]) -> torch.Tensor:
    """`bounds` as an int64 tensor, kept per thread while the same list comes back (every layer of a step)."""
    kept = getattr(_bounds, "kept", None)
    if kept is None or kept[0] is not bounds:
        kept = _bounds.kept = (bounds, torch.tensor(bounds, dtype=torch.int64))
    return kept[1]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
                     host_lengths: list[int], scale: float, bounds: list[int] | None = None) -> torch.Tensor:
    """q [B, Hq, D]; k/v [slots, Hkv, cap, D]; request b reads cache row rows[b] to lengths[b] (int64, host;
    also `host_lengths`) -> [B, Hq·D] in q's dtype. `bounds`: the split over threads (`cuts`), kept a step."""
    lib = library()
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    out = torch.empty((B, Hq * D), dtype=q.dtype)
    if B == 0:
        return out
    n = max(1, min(torch.get_num_threads(), B))
    bounds = bounds if bounds is not None and len(bounds) == n + 1 else cuts(host_lengths, n)
    pool = _pool(1 if lib.openmp else n)
    longest = max(host_lengths)
    G = Hq // Hkv
    qb, kb, ob = int(q.dtype == torch.bfloat16), int(k.dtype == torch.bfloat16), int(q.dtype == torch.bfloat16)
    args = (q.data_ptr(), qb, q.stride(0), k.data_ptr(), v.data_ptr(), kb, rows.data_ptr(), lengths.data_ptr())
    status = [0] * n

    def part(j):
        if bounds[j] < bounds[j + 1]:
            s = pool.buffer(j, G * longest)
            status[j] = lib.fn(*args, bounds[j], bounds[j + 1], Hkv, G, D, k.stride(0), k.stride(1), scale,
                               out.data_ptr(), ob, s.data_ptr(), longest)

    if lib.openmp and n > 1:  # torch's own OpenMP threads run the parts
        b = _bounds_tensor(bounds)
        s = pool.buffer(0, n * G * longest)
        status[0] = lib.parts(*args, b.data_ptr(), n, Hkv, G, D, k.stride(0), k.stride(1), scale, out.data_ptr(), ob,
                              s.data_ptr(), longest)
    else:  # one part runs on the calling thread
        pool.run([functools.partial(part, j) for j in range(n)])
    if any(status):
        raise RuntimeError(f"decode attention kernel refused G={G}, D={D}")
    return out
