"""Shared fixtures: an isolated cache dir per session and tiny checkpoints built once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if os.environ.get("MLIGHT_TEST_INSTALLED"):  # packaging/check_wheel.sh: test the installed wheel, not this checkout
    import core

    assert not Path(core.__file__).resolve().is_relative_to(ROOT), f"{core.__file__} is the checkout's, not installed"
else:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ["MLIGHT_STRICT_KERNEL_CALLS"] = "1"  # core.model.cpu.native.bind: a C kernel called with a wrong count fails


def pytest_sessionstart(session):
    """Demo model, probe and kernel caches go to a temp dir, never the user's: set before collection, since test
    modules build C kernels as they are imported."""
    factory = session.config._tmp_path_factory
    cache = factory.mktemp("mlight-cache")
    base = factory.getbasetemp()  # pytest-N (serial), pytest-N/popen-gwK (an xdist worker)
    _CACHE["kernels"] = (base.parent.parent if hasattr(session.config, "workerinput") else base.parent) \
        / "mlight-test-kernels"
    _link_kernels(cache, _CACHE["kernels"])
    _CACHE["old"] = {k: os.environ.get(k) for k in ("MLIGHT_CACHE_DIR", "MLIGHT_RESULTS_DIR")}
    _CACHE["dir"] = cache
    os.environ["MLIGHT_CACHE_DIR"] = str(cache)
    os.environ["MLIGHT_RESULTS_DIR"] = str(factory.mktemp("mlight-results"))  # never ~/Documents


_CACHE: dict = {}


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache():
    """The session's cache dir (pytest_sessionstart's); the environment as it was, after the session."""
    yield _CACHE["dir"]
    for k, v in _CACHE["old"].items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _link_kernels(cache: Path, kernels: Path) -> None:
    """The C kernels the tests build go to one folder beside pytest's numbered temp dirs, kept from run to run:
    xdist's workers, the processes the tests start (ranks, the CLI, bench scripts) and the next run find what
    one of them built (0.5-7 s of compiler time a kernel, about 20 s for all of them) instead of building it
    again. Safe to share: a kernel's file name hashes its source, compiler and flags, and it lands by an
    atomic rename. Where a link cannot be made (Windows without the right), the session builds its own."""
    kernels.mkdir(exist_ok=True)
    try:
        (cache / "kernels").symlink_to(kernels, target_is_directory=True)
    except OSError:
        pass


@pytest.fixture(scope="session")
def shared_kernels():
    """`link(cache)`: a fresh cache folder that a test's child process uses finds the session's C kernels
    (each a compiler run of seconds) while everything else in it starts empty."""
    def link(cache: Path) -> Path:
        cache.mkdir(parents=True, exist_ok=True)
        _link_kernels(cache, _CACHE["kernels"])
        return cache

    return link


@pytest.fixture
def kernel_cache(monkeypatch, tmp_path, request, shared_kernels):
    """`use(kernel, shared=True)`: this test builds (or fails to build) its own `kernel` (a native.Kernel, its
    builds forgotten now and after the test: none kept in memory from another test) in a cache dir
    of its own. `shared`: the dir holds the session's C kernels (a kernel's file name hashes its source, compiler
    and flags, so flags another test compiled load that library instead of about 2 s of compiler); else empty,
    the kernel compiled now as on a user's first run."""
    def use(kernel, shared: bool = True) -> None:
        cache = tmp_path / "cache"
        monkeypatch.setenv("MLIGHT_CACHE_DIR", str(shared_kernels(cache) if shared else cache))
        kernel.cache_clear()
        request.addfinalizer(kernel.cache_clear)

    return use


@pytest.fixture(scope="session")
def checkpoint_factory(request, tmp_path_factory):
    """family -> path of a tiny checkpoint of that family (built once per session)."""
    from checkpoints import make_checkpoint

    made: dict[str, Path] = {}
    # tests/mutation.py: one pytest session per mutant; building the checkpoints once for all of them
    # (they are deterministic: fixed seed) halves the time a mutant of the engine takes. xdist's workers
    # of one run share them the same way, under the run's common temp folder
    shared = os.environ.get("MLIGHT_TEST_CHECKPOINTS")
    if not shared and _xdist_workers(request.config) > 1:
        shared = str(tmp_path_factory.getbasetemp().parent / "checkpoints")  # the run's folder: workers' parent

    def get(family: str) -> Path:
        if family not in made:
            made[family] = (_shared_checkpoint(Path(shared), family, make_checkpoint) if shared else
                            make_checkpoint(family, tmp_path_factory.mktemp(f"ckpt-{family}")))
        return made[family]

    return get


def _shared_checkpoint(root: Path, family: str, make) -> Path:
    """`family`'s checkpoint under root, built by the first session that asks (into a private folder,
    then renamed: a concurrent session never reads a half-written one)."""
    import shutil
    import tempfile

    from filelock import FileLock  # torch's own dependency

    final = root / family
    if not final.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(root / f".{family}.lock")):  # the others wait for it rather than build it again
            if not final.is_dir():
                tmp = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=root))
                make(family, tmp)
                try:
                    tmp.rename(final)
                except OSError:  # a session that does not take the lock got there first
                    shutil.rmtree(tmp, ignore_errors=True)
    return final


@pytest.fixture(scope="session")
def demo_model(_isolated_cache):
    from core.model.demo import demo_model_dir

    return demo_model_dir()


@pytest.fixture
def roomy_ram(monkeypatch):
    """The machine as a 24 GiB box with 20 GiB free, whatever else this host is running: planning on
    "the detected machine" must not depend on how busy the test machine's memory happens to be."""
    import collections

    import psutil

    vm = collections.namedtuple("svmem", "total available percent used free")
    fake = vm(24 * 2**30, 20 * 2**30, 16.7, 4 * 2**30, 20 * 2**30)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: fake)
    return fake


# ---- device choice: the suite runs on the CPU everywhere; `--cuda` adds the real-GPU subset ---------
def pytest_addoption(parser):
    parser.addoption("--cuda", action="store_true", default=False,
                     help="also run the tests marked `cuda` on this machine's GPU (they are skipped otherwise)")
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="list the N tests that took the most CPU seconds (this process's threads and the "
                          "subprocesses it waited for), 0 for all: on a shared machine wall times say more "
                          "about the other jobs")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: runs on a real CUDA GPU; only with --cuda")
    # Engine.load's default device is CUDA when present: tests that mean the CPU must get the CPU,
    # in this process and in the subprocesses they start (tests that want a GPU name it)
    os.environ["MLIGHT_DEVICE"] = "cpu"
    workers = _xdist_workers(config)
    if workers > 1:  # each worker its share of the cores: 2 workers x 2 threads on CI's 2 cores stall each other
        import torch

        from core.platform import usable_cores

        torch.set_num_threads(max(1, usable_cores() // workers))


def pytest_collection_modifyitems(config, items):
    if _xdist_workers(config) > 1:
        # the modules with long end-to-end tests go out first (pytest_cmdline_main: a module at a time to
        # whichever worker is free), so the run's last minute is short tests on every worker rather than one
        # worker finishing a long one alone. In their order otherwise (stable)
        slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
        items.sort(key=lambda item: item.path not in slow)
    if config.getoption("--cuda"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run with --cuda")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


# ---- parallel runs: pyproject's addopts ask xdist for `-n auto`; this sizes it and deals the modules ------
@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Whole modules, in collection order, each to the next worker that runs short of tests (xdist's
    `loadfile` without its reordering by size), unless --dist says otherwise. xdist's default (`load`) gives
    each worker a first block of a quarter of its share, in order: on CI's 2 workers the first 271 tests,
    every slow module and the app's first ones, went to one worker, and the other, done with the rest, had
    nothing left to take. A whole module to one worker also builds its module fixtures (checkpoints, GGUF files,
    rank processes) once."""
    opt = config.option
    chosen = getattr(opt, "dist", None) != "no" or getattr(opt, "distload", False)  # absent without xdist
    if getattr(opt, "numprocesses", None) and not chosen:
        opt.dist, opt.loadscopereorder = "loadfile", False


MAX_WORKERS = 8  # beyond this, each worker's start-up (torch, checkpoints, the demo model) outweighs its share
# a worker's peak resident set, with room: 0.75-0.95 GB measured mid-run with 2 workers (the whole suite in
# one process peaks at 2.3 GB); CI's 2-core runners have 7 GB
WORKER_RAM = 2 * 2**30


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run without xdist (check_wheel.sh) never calls it
def pytest_xdist_auto_num_workers(config):
    """One worker per usable core (CI's 2 cores: 2), at most MAX_WORKERS and as many as the free memory
    holds; none (the tests run in this process) where that is one. PYTEST_XDIST_AUTO_NUM_WORKERS or
    `-n N` set it by hand, `-n 0` runs serially."""
    import psutil

    from core.platform import usable_cores

    env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if env:
        return int(env)
    n = min(usable_cores(), MAX_WORKERS, psutil.virtual_memory().available // WORKER_RAM)
    return n if n > 1 else 0


def _xdist_workers(config) -> int:
    """How many workers this run has, read in one of them (0 in the controller or a serial run). Not from
    PYTEST_XDIST_WORKER_COUNT: a child pytest a test starts (the AVX2 lane) inherits that and is no worker."""
    return getattr(config, "workerinput", {}).get("workercount", 0)


@pytest.fixture
def task_fault(monkeypatch):
    """`task_fault(f)`: every pipeline runner calls f(task) before it runs a task, to inject a failure or a delay."""
    from core.runtime.pipeline import PipelineRunner

    def inject(fault):
        run = PipelineRunner._run

        def faulty(self, task):
            fault(task)
            run(self, task)

        monkeypatch.setattr(PipelineRunner, "_run", faulty)

    return inject


@pytest.fixture(autouse=True)
def _one_gpu_test_at_a_time(request, tmp_path_factory):
    """With --cuda and several workers, the real-GPU tests take turns: their memory and pinning figures are
    the device's, and a second worker's engine on the same GPU would move them."""
    if request.node.get_closest_marker("cuda") is None or _xdist_workers(request.config) < 2:
        yield
        return
    from filelock import FileLock

    with FileLock(str(tmp_path_factory.getbasetemp().parent / "cuda.lock")):
        yield


# ---- --cpu-durations: CPU seconds per test phase, reported beside pytest's wall --durations -----------------
def _cpu_seconds() -> float:
    try:
        import resource
    except ImportError:  # Windows: no rusage, nothing to report
        return 0.0
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _timed(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _timed(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _timed(item, "teardown")


def _timed(item, when: str):
    """Record the phase's CPU seconds in the report's user_properties (they travel from xdist workers)."""
    if item.config.getoption("--cpu-durations") is None:
        yield
        return
    start = _cpu_seconds()
    yield
    item.user_properties.append((f"cpu_{when}", _cpu_seconds() - start))


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("--cpu-durations")
    if n is None:
        return
    rows = []
    for reports in terminalreporter.stats.values():
        for r in reports:
            for key, secs in getattr(r, "user_properties", ()):
                if key == f"cpu_{getattr(r, 'when', '')}":
                    rows.append((secs, r.when, r.nodeid))
    rows.sort(reverse=True)
    terminalreporter.write_sep("=", f"{'all' if not n else f'most {n}'} CPU durations "
                                    f"(total {sum(s for s, _, _ in rows):.1f} s)")
    for secs, when, nodeid in rows[:n or None]:
        terminalreporter.write_line(f"{secs:.2f}s {when:<8} {nodeid}")
