"""The new layer pieces against references: RoPE scalings, decode vs prefill forms of each token mixer
(sinks and windows, MLA absorbed vs expanded, Gated DeltaNet recurrent vs chunked)."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from core.model import linear_attention, mla
from core.model.attention import decode_attention, prefill_attention
from core.model.kvcache import KVStore, LatentStore, LinearStore, Rows
from core.model.rope import inv_freq
from core.model.spec import LinearAttnSpec, MLASpec, ModelSpec, RopeSpec


@pytest.mark.parametrize("params", [
    dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    dict(rope_type="yarn", factor=40.0, mscale=0.707, mscale_all_dim=0.707, original_max_position_embeddings=4096),
    dict(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.8, original_max_position_embeddings=128),
])
def test_yarn_frequencies_and_scale_match_transformers(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=8192,
                      rope_parameters={"rope_theta": 150000.0, **params})
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    r = RopeSpec(theta=150000.0, kind="yarn", factor=params["factor"], original_max=params["original_max_position_embeddings"],
                 beta_fast=params.get("beta_fast", 32.0), beta_slow=params.get("beta_slow", 1.0),
                 truncate=params.get("truncate", True), mscale=params.get("mscale", 0.0),
                 mscale_all_dim=params.get("mscale_all_dim", 0.0))
    got, scale = inv_freq(r, 64, 8192)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale)


def test_sinks_and_window_decode_equals_the_last_row_of_prefill():
    torch.manual_seed(0)
    L, Hq, Hkv, hd, W = 37, 8, 2, 16, 8
    q, k, v = torch.randn(L, Hq, hd), torch.randn(L, Hkv, hd), torch.randn(L, Hkv, hd)
    sinks = torch.randn(Hq)
    full = prefill_attention(q, k, v, 0.25, window=W, sinks=sinks)
    # the store keeps the last W tokens in a ring; decode of token L-1 sees exactly those
    store = KVStore(1, Hkv, hd, 64, torch.float32, window=W)
    store.write_prompt(0, k[:-1], v[:-1])
    rows = Rows([0], [L - 1])
    store.write(rows.slots, rows.positions, k[-1:], v[-1:])
    lengths, span, pad = rows.kept(store)
    out = decode_attention(q[-1:], store.k, store.v, lengths, 0.25, span, pad, sinks=sinks)
    torch.testing.assert_close(out[0], full[-1], rtol=1e-5, atol=1e-6)
    # and the explicit prefill equals a direct computation with the sink in the denominator
    s = torch.einsum("hd,thd->ht", q[-1], k[L - W:].repeat_interleave(Hq // Hkv, 1)) * 0.25
    p = torch.softmax(torch.cat((s, sinks[:, None]), 1), 1)[:, :-1]
    ref = torch.einsum("ht,thd->hd", p, v[L - W:].repeat_interleave(Hq // Hkv, 1)).reshape(-1)
    torch.testing.assert_close(full[-1], ref, rtol=1e-5, atol=1e-6)


def _mla_spec(q_lora=0) -> ModelSpec:
    return ModelSpec(architecture="DeepseekV3ForCausalLM", family="deepseek_v3", num_layers=1, hidden_size=64,
                     num_heads=4, num_kv_heads=4, head_dim=24, vocab_size=8, num_experts=1, top_k=1,
                     expert_intermediate=1, mla=MLASpec(q_lora, 32, 16, 8, 16), attn_scale=24 ** -0.5,
                     rope=RopeSpec(pairs=True))


def test_mla_absorbed_decode_equals_expanded_attention():
    """Decode over the latent cache with W_UK/W_UV absorbed gives what expanding K and V does."""
    from core.model.rope import for_spec

    torch.manual_seed(1)
    spec = _mla_spec(q_lora=24)
    w = {n: torch.randn(s) * 0.2 for n, s in spec.attn_shapes(0).items()}
    L = 13
    h = torch.randn(L, 64)
    rope = for_spec(spec, 64, torch.float32)
    pos = torch.arange(L)
    out, parts = mla.prefill(spec, w, h, pos, rope, [L])
    store = LatentStore(1, 40, 64, torch.float32)
    store.write_prompt(0, parts[0][0][:-1])
    rows = Rows([0], [L - 1])
    payload, keep = mla.pre(spec, w, h[-1:], pos[-1:], rope)
    o = mla.post(spec, w, mla.attend(spec, w, payload, store, rows), keep)
    torch.testing.assert_close(o[0], out[-1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(store.lat[0, :L], parts[0][0])  # the new token's latent was stored


def _gdn_spec() -> ModelSpec:
    return ModelSpec(architecture="Qwen3NextForCausalLM", family="qwen3_next", num_layers=1, hidden_size=64,
                     num_heads=2, num_kv_heads=1, head_dim=16, vocab_size=8, num_experts=1, top_k=1,
                     expert_intermediate=1, layer_types=("linear",), norm="rms_offset",
                     linear=LinearAttnSpec(num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=8, conv_kernel=4))


@pytest.mark.parametrize("L", [1, 3, 64, 150])
def test_delta_rule_chunked_prefill_equals_token_by_token_decode(L):
    """Prefill in chunks (across chunk boundaries too) and decode one token at a time give the same
    outputs and leave the same recurrent and conv states."""
    torch.manual_seed(L)
    spec = _gdn_spec()
    w = {n: torch.randn(s) * 0.3 for n, s in spec.attn_shapes(0).items()}
    h = torch.randn(L + 1, 64)
    out, parts = linear_attention.prefill(spec, w, h, lens=[L + 1])
    st = LinearStore(1, spec, torch.float32)
    steps = []
    for t in range(L + 1):
        payload, z = linear_attention.pre(spec, w, h[t:t + 1])
        steps.append(linear_attention.post(spec, w, linear_attention.attend(spec, w, payload, st, Rows([0], [t])), z))
    torch.testing.assert_close(torch.cat(steps), out, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(st.rec[0], parts[0][0], rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(st.conv[0], parts[0][1])


def test_delta_rule_matches_transformers_chunked_kernel():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    torch.manual_seed(7)
    H, L, dk, dv = 3, 100, 16, 8
    q, k = F.normalize(torch.randn(H, L, dk), dim=-1) * dk ** -0.5, F.normalize(torch.randn(H, L, dk), dim=-1)
    v, g, beta = torch.randn(H, L, dv), -torch.rand(H, L), torch.rand(H, L)
    got, state = linear_attention.chunked_delta_rule(q, k, v, g, beta)
    want, want_state = torch_chunk_gated_delta_rule(
        q.transpose(0, 1)[None] * dk ** 0.5, k.transpose(0, 1)[None], v.transpose(0, 1)[None], g=g.t()[None],
        beta=beta.t()[None], output_final_state=True)
    torch.testing.assert_close(got, want[0].transpose(0, 1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, want_state[0], rtol=1e-4, atol=1e-5)
