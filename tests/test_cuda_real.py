"""The CUDA subset: the same checks as the emulated-device tests, on a real GPU.

Skipped unless pytest runs with `--cuda` on a machine with a CUDA GPU (tests/conftest.py); everything
here also runs in CI over the emulated device (test_cuda_executor.py, test_gpu_memory.py).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from core.runtime.engine import Engine, Request
from core.runtime.executors import TaskFailed

pytestmark = pytest.mark.cuda

PROMPTS = ["Hi", "Compose an engaging travel blog post about Hawaii.", "x y z", "What is 2+2? Explain.",
           "Draft an email to a colleague.", "Tell me a story about a cat and a dog"]


@pytest.fixture(autouse=True)
def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


def tokens(engine, batch=4, micro=2):
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=5) for i, p in enumerate(PROMPTS)]
    return {r.id: r.output_token_ids for r in engine.generate(reqs, batch_size=batch, micro_batch_size=micro)}


@pytest.mark.parametrize("schedule", ["cgopipe", "s3", "s4"])
def test_cuda_executor_matches_the_cpu_engine(checkpoint_factory, schedule):
    path = checkpoint_factory("qwen2_moe")
    want = tokens(Engine.load(path, device="cpu"))
    engine = Engine.load(path, device="cuda", executor="cuda", schedule=schedule, pages_per_layer=2,
                         resident_experts=(1, 3))
    engine.eos_ids = set()
    try:
        assert tokens(engine) == want
    finally:
        engine.close()


def test_a_failing_task_on_the_gpu_fails_the_step_quickly(checkpoint_factory, task_fault):
    engine = Engine.load(checkpoint_factory("mixtral"), device="cuda", executor="cuda", resident_layers=0)

    def fault(task):
        if task.kind == "ffn" and task.layer == 1:
            raise ValueError("injected")

    task_fault(fault)
    out = {}

    def run():
        try:
            tokens(engine)
        except TaskFailed as e:
            out["err"] = e

    t0 = time.monotonic()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(30)
    engine.close()
    assert not th.is_alive() and isinstance(out["err"].__cause__, ValueError) and time.monotonic() - t0 < 30


def test_pinning_registers_exactly_what_streams(checkpoint_factory):
    from core.runtime.device import CudaDevice

    dev = CudaDevice("cuda")
    engine = Engine.load(checkpoint_factory("mixtral"), device=dev, executor="cuda", resident_layers=0)
    engine.eos_ids = set()
    tokens(engine)
    assert engine.weights.pinned
    streamed = sum(v.numel() * v.element_size() for _, v in engine.weights.pins.values())
    assert streamed <= dev.pinned_bytes <= streamed + 2 * 4096 * len(engine.weights.pins)  # whole pages, no more
    engine.close()
    assert not engine.weights.pinned


def test_two_runs_peak_where_one_does(checkpoint_factory):
    engine = Engine.load(checkpoint_factory("mixtral"), device="cuda", executor="cuda", resident_layers=0)
    engine.eos_ids = set()
    torch.cuda.reset_peak_memory_stats()
    tokens(engine)
    first = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    tokens(engine)
    engine.close()
    assert torch.cuda.max_memory_allocated() <= first


def test_a_refused_registration_falls_back_and_leaves_cuda_working():
    """cudaHostRegister refused (here: the range is already registered behind the device's back) returns
    False, and its error must not surface as the next kernel's failure; past the budget nothing is asked."""
    from core.runtime.device import CudaDevice

    dev = CudaDevice("cuda")
    host = torch.empty(1 << 20, dtype=torch.uint8)
    start = host.data_ptr() // 4096 * 4096
    assert int(torch.cuda.cudart().cudaHostRegister(start, (1 << 20) - 4096, 0)) == 0
    try:
        assert not dev.pin(host) and dev.pinned_bytes == 0
        assert (torch.ones(4, device="cuda") * 2).sum().item() == 8  # no stale error from the refusal
    finally:
        torch.cuda.cudart().cudaHostUnregister(start)
    small = CudaDevice("cuda", pin_limit_bytes=4096)
    assert not small.pin(torch.empty(1 << 20, dtype=torch.uint8)) and small.pinned_bytes == 0


def test_engines_of_several_families_one_after_another_leave_no_cuda_error_behind(checkpoint_factory):
    """Found on the first real-GPU run (bench/gpu_check.py parity): after Mixtral's and DBRX's engines had run
    and closed, Qwen2-MoE's first copy failed with "CUDA error: invalid argument" — an error from work outside
    torch (page-locking) surfacing far from its cause. Each engine closes leaving no error pending."""
    from core.runtime.device import resolve_device

    for family in ("mixtral", "dbrx", "qwen2_moe"):
        path = checkpoint_factory(family)
        want = tokens(Engine.load(path, device="cpu"))
        for paging in (dict(pages_per_layer=1, resident_layers=0), dict(pages_per_layer=3, resident_layers=1)):
            engine = Engine.load(path, device="cuda", executor="cuda", **paging)
            assert tokens(engine) == want, (family, paging)
            engine.close()
            assert engine.dev.runtime_errors == [], (family, paging)
            assert resolve_device("cuda").pending_error() is None, (family, paging)


@pytest.mark.parametrize("kind,G,keep,k,E,scale", [("sigmoid_group", 8, 4, 8, 256, 2.5), ("softmax_group", 8, 3, 6, 64, 1.0),
                                                   ("softmax", 1, 1, 8, 128, 1.0)])
def test_the_router_op_runs_its_kernel_and_gives_the_torch_forms_experts(kind, G, keep, k, E, scale):
    """mlight::route on the GPU (core.model.router_triton, compiled) against its torch form on the CPU
    (test_router_triton.py holds the kernel in the interpreter): the same ids, weights within a bf16 ulp."""
    from core.model import fused_router

    g = torch.Generator().manual_seed(E)
    x = 2 * torch.randn(64, E, generator=g)
    bias = (0.1 * torch.randn(E, generator=g)).to(torch.bfloat16) if kind == "sigmoid_group" else None
    args = (kind, k, G, keep, True, scale, torch.bfloat16)
    w, i = torch.ops.mlight.route(x.cuda(), None if bias is None else bias.cuda(), *args)
    w0, i0 = fused_router.torch_form(x, bias, *args)
    assert torch.equal(i.cpu(), i0)
    assert ((w.cpu().float() - w0.float()).abs() <= 2.0 ** -8 * w0.float().abs()).all()


def test_moe_align_runs_its_kernel_and_gives_the_torch_forms_layout():
    from core.model.moe_align import moe_align

    ids = torch.rand(300, 256, generator=torch.Generator().manual_seed(0)).topk(8, -1).indices
    for got, want in zip(torch.ops.mlight.moe_align(ids.cuda(), 256, 16), moe_align(ids, 256, 16)):
        assert torch.equal(got.cpu(), want)


def test_deepseek_v3_on_the_gpu_gives_the_cpu_engines_tokens(checkpoint_factory):
    """The router kernel, the fp32 router kept on the device and q_a ‖ kv_a in one product, end to end."""
    path = checkpoint_factory("deepseek_v3")
    want = tokens(Engine.load(path, device="cpu"))
    engine = Engine.load(path, device="cuda", executor="cuda", schedule="cgopipe", pages_per_layer=2)
    engine.eos_ids = set()
    try:
        assert tokens(engine) == want
    finally:
        engine.close()
