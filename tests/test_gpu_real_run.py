"""What the first run on a real GPU measured (bench/gpu_check.py on an H200, bench/RESULTS.md "GPU path on a
real GPU"), kept as anchors for the model that predicted it.

The offload stage ran a 10-layer Mixtral-8x7B-shaped bf16 model (29.6 GB) under a 16 GB cap: the planner chose
N = 128, μ = 4, r_w = 0.25, 32 pages, and promised 393 ms decode steps; the steps took 985 ms (128 tokens at
130.0 tok/s), launch-bound on the host. The planner's host costs per task and per op were the emulator's."""

from __future__ import annotations

import dataclasses

from transformers import MixtralConfig

from core.model.families import load_spec
from core.plan.hardware import preset
from core.plan.planner import Budget, Workload, plan, predict
from core.plan.policy import Policy

MEASURED_DECODE_STEP = 128 / 129.97  # seconds: decode_tokens_per_s of the CGOPipe run at μ = 4
WORK = Workload(prompt_len=77, gen_len=16, max_prompt_len=418, num_requests=128)
CAP = int(16e9)


def _run(tmp_path):
    cfg = MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=10,
                        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=4096, tie_word_embeddings=False)
    cfg.dtype, cfg.architectures = "bfloat16", ["MixtralForCausalLM"]
    cfg.save_pretrained(str(tmp_path))
    hw = preset("h100")  # the H200's figures where the run measured or its datasheet gives them
    hw = dataclasses.replace(hw, gpu_name="NVIDIA H200", gpu_mem_bytes=CAP, gpu_mem_free_bytes=None, gpu_bw=4.8e12,
                             h2d_bw=54.9e9, d2h_bw=55.1e9, cpu_mem_bytes=125 * 2**30, cpu_cores=16,
                             measured=tuple(sorted(set(hw.measured) | {"h2d_bw", "d2h_bw", "gpu_bw"})))
    return load_spec(tmp_path), hw


def test_the_measured_decode_step_is_predicted_within_ten_percent(tmp_path, monkeypatch):
    """Priced on the expert path that run took: grouped_mm (33 ops an FFN task; the fused path issues 12)."""
    from core.plan import hrm

    monkeypatch.setattr(hrm, "expert_path", lambda m, r, tokens: "grouped")
    spec, hw = _run(tmp_path)
    ran = Policy(batch_size=128, micro_batch_size=4, expert_batch_size=4, attention_on="cpu", ffn_on="gpu",
                 gpu_weight_fraction=0.25, pages_per_layer=32)
    pred = predict(ran, spec, hw, WORK)
    assert abs(pred.step_seconds / MEASURED_DECODE_STEP - 1) < 0.10, pred.step_seconds
    assert pred.bottleneck == "host"  # what the run was bound by, and what the prediction now says


def test_the_planner_no_longer_chooses_that_launch_bound_policy(tmp_path):
    spec, hw = _run(tmp_path)
    policy, pred = plan(spec, hw, WORK, Budget(gpu_bytes=CAP, cpu_bytes=int(0.8 * hw.cpu_mem_bytes)), ranks=1)
    assert policy.micro_batch_size >= 16 and pred.bottleneck != "host", (policy, pred.bottleneck)
