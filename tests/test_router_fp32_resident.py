"""An fp32 router (DeepSeek-V3, GLM-4.5) is kept in fp32 on the device, not cast every micro-batch: the planner
prices the bytes the device holds for it, and the engine's tokens stay the reference's (tests/test_families*)."""

from __future__ import annotations

import torch

from checkpoints import make_checkpoint
from core.model.families import load_spec
from core.plan import hrm
from core.runtime.device_emulated import EmulatedCuda
from core.runtime.engine import Engine

MiB = 1 << 20


def test_the_planner_prices_the_non_expert_weights_the_device_holds(tmp_path):
    path = make_checkpoint("deepseek_v3", tmp_path / "v3", dtype=torch.bfloat16)
    spec = load_spec(path)
    engine = Engine.load(path, device=EmulatedCuda(512 * MiB), executor="cuda", schedule="cgopipe",
                         dtype="bfloat16", pages_per_layer=2, resident_experts=(2,) * spec.num_layers)
    try:
        runner = engine.runner(slots=2, micro_batch_size=1, max_tokens=8)
        held = {id(t): t.numel() * t.element_size() for w in (*runner.dense, runner.globals) for t in w.values()}
        routers = [w["router"] for i, w in enumerate(runner.dense) if spec.is_moe(i)]
    finally:
        engine.close()
    assert routers and all(r.dtype == torch.float32 for r in routers)
    assert sum(held.values()) == hrm.gpu_nonexpert_bytes(spec)
    assert hrm.gpu_nonexpert_bytes(spec) - spec.nonexpert_bytes == spec.moe_layers * spec.num_experts * spec.hidden_size * 2
