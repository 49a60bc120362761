"""Every router kind against the reference router module of its family, on many random tokens."""

from __future__ import annotations

import pytest
import torch

from core.model.routing import route
from core.model.spec import ModelSpec

D, E, T = 32, 16, 512


def _spec(**kw) -> ModelSpec:
    base = dict(architecture="X", family="x", num_layers=1, hidden_size=D, num_heads=2, num_kv_heads=2, head_dim=16,
                vocab_size=8, num_experts=E, top_k=kw.pop("top_k", 4), expert_intermediate=8)
    return ModelSpec(**base, **kw)


def _check(spec, w, ref_weights, ref_idx, h):
    weights, idx = route(spec, h, w)
    # the same experts with the same weights, in whatever order each side lists them
    got = torch.zeros(T, E, dtype=torch.float64).scatter_(1, idx, weights.double())
    want = torch.zeros(T, E, dtype=torch.float64).scatter_(1, ref_idx, ref_weights.double())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_v3_and_glm_router_limits_tokens_to_the_best_groups():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=4, n_group=4, topk_group=2,
                           norm_topk_prob=True, routed_scaling_factor=2.5)
    ref = DeepseekV3TopkRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        ref.weight.normal_(0, 0.5)
        ref.e_score_correction_bias.normal_(0, 0.3)
    h = torch.randn(T, D)
    spec = _spec(router="sigmoid_group", router_correction=True, router_fp32=True, router_groups=4,
                 router_topk_groups=2, routed_scale=2.5)
    w = {"router": ref.weight.detach(), "e_bias": ref.e_score_correction_bias}
    _, ref_w, ref_i = ref(h)
    _check(spec, w, ref_w, ref_i, h)
    # the limit bites: without groups many tokens would pick experts from more than 2 groups
    free = _spec(router="sigmoid_group", router_correction=True, router_fp32=True, routed_scale=2.5)
    _, free_idx = route(free, h, w)
    _, idx = route(spec, h, w)
    spread = lambda i: torch.tensor([len(set((r // 4).tolist())) for r in i])  # noqa: E731
    assert (spread(idx) <= 2).all() and (spread(free_idx) > 2).sum() > T // 4


def test_v2_group_limited_greedy_softmax_router():
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=4, n_group=4, topk_group=2,
                           topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    ref = DeepseekV2TopkRouter(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        ref.weight.normal_(0, 0.5)
    h = torch.randn(T, D)
    spec = _spec(router="softmax_group", router_norm="none", router_fp32=True, router_groups=4, router_topk_groups=2,
                 routed_scale=1.5)
    _, ref_w, ref_i = ref(h)
    _check(spec, {"router": ref.weight.detach()}, ref_w, ref_i, h)


def test_gpt_oss_router_takes_top_k_logits_then_softmax():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    ref = GptOssTopKRouter(GptOssConfig(hidden_size=D, num_local_experts=E, num_experts_per_tok=4))
    torch.manual_seed(2)
    with torch.no_grad():
        ref.weight.normal_(0, 0.5)
        ref.bias.normal_(0, 0.5)
    h = torch.randn(T, D)
    _, ref_w, ref_i = ref(h)
    spec = _spec(router="topk_softmax", router_bias=True)
    _check(spec, {"router": ref.weight.detach(), "router_bias": ref.bias.detach()}, ref_w, ref_i, h)


@pytest.mark.parametrize("jitter", [0.01, 0.3])
def test_phi_sparse_mixer_inference_form(jitter):
    from transformers import PhimoeConfig
    from transformers.models.phimoe.modeling_phimoe import PhimoeTopKRouter

    ref = PhimoeTopKRouter(PhimoeConfig(hidden_size=D, num_local_experts=E, num_experts_per_tok=2,
                                        router_jitter_noise=jitter)).eval()
    torch.manual_seed(3)
    with torch.no_grad():
        ref.weight.normal_(0, 0.2)
    h = torch.randn(T, D)
    with torch.no_grad():
        _, ref_w, ref_i = ref(h)
    spec = _spec(router="sparsemixer", router_jitter=jitter, top_k=2)
    _check(spec, {"router": ref.weight.detach()}, ref_w, ref_i, h)
