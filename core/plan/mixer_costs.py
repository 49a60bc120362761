"""FLOPs and bytes of each token-mixer kind per layer, for the HRM: one `MixerCost` per layer group, averaged by
core.plan.hrm, so an "average layer" costs what the real mix of layers does. No torch, no rates.
Legend: t = query tokens, c = cached tokens (context), s = prompt tokens, D = hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.model.limits import LINEAR_CHUNK as CHUNK
from core.model.limits import SCORE_BLOCK_ELEMS
from core.model.spec import ModelSpec, StateSpec


@dataclass(frozen=True)
class MixerCost:
    count: int  # layers of this kind
    kind: str  # "gqa" | "mla" | "linear"
    state: StateSpec  # what a sequence keeps in one such layer
    pre_params: int  # weights read by the projections before attention (MLA: + W_UK)
    post_params: int  # weights read after it (MLA: W_UV and O)
    d1: int  # elements per token to the CPU (D1)
    d2: int  # elements per token back (D2)
    ctx_flops: float  # decode attention FLOPs per query token per cached token
    query_flops: float  # decode attention FLOPs per query token, whatever the context
    query_elems: float  # elements per query token read/written besides the state (q, output)
    prefill_tok_flops: float  # prefill FLOPs per prompt token besides the pairwise part
    pair_flops: float  # prefill FLOPs per (query, visible key) pair
    # a prefill's device working set beyond the hidden states, bytes: per token of the micro-batch, of the prompt
    # in hand (attended one at a time), per (query, key) pair of it, per chunk-padded token (linear attention)
    pf_tok: float = 0.0
    pf_seq: float = 0.0
    pf_pair: float = 0.0
    pf_chunk: float = 0.0
    heads: int = 1  # query heads (the scores' block is counted over all of them)
    pf_blocked: bool = False  # the scores are made block by block, at most SCORE_BLOCK_ELEMS at a time

    def decode(self, t: float, c: float, dt: int) -> tuple[float, float]:
        kept = self.state.tokens_kept(c)
        state_bytes = self.state.bytes(c, dt)
        if self.kind == "linear":  # the state is read and written back, once per token
            state_bytes *= 2
        return t * (kept * self.ctx_flops + self.query_flops), t * (state_bytes + self.query_elems * dt)

    def prefill(self, seqs: float, s: float, dt: int) -> tuple[float, float]:
        """Causal; a window caps the visible keys."""
        w = self.state.window
        pairs = s * (s + 1) / 2 if not w or s <= w else w * (w + 1) / 2 + (s - w) * w
        if self.kind == "linear":
            pairs = 0.0
        return seqs * (pairs * self.pair_flops + s * self.prefill_tok_flops), seqs * s * (self.d1 + self.d2) * dt

    def prefill_bytes(self, tokens: float, s: float) -> float:
        """Device bytes a prefill of `tokens` tokens holds at its peak in this mixer, prompts of `s` tokens."""
        padded = -(-s // CHUNK) * CHUNK
        pairs = min(s * s, max(SCORE_BLOCK_ELEMS / self.heads, s)) if self.pf_blocked else s * s
        return tokens * self.pf_tok + s * self.pf_seq + pairs * self.pf_pair + padded * self.pf_chunk

    def new_token_bytes(self, dt: int) -> float:
        """Bytes of state one decode token writes back (its K/V or latent; a linear layer's whole state)."""
        if self.kind == "linear":
            return self.state.bytes(0, dt)
        return self.state.token_elems * dt


def mixer_costs(spec: ModelSpec) -> tuple[MixerCost, ...]:
    groups: dict[tuple, list] = {}
    for i in range(spec.num_layers):
        st = spec.layer_state(i)
        groups.setdefault((st.kind, st.window), [0, st])[0] += 1
    return tuple(_cost(spec, st, n) for n, st in groups.values())


def _cost(spec: ModelSpec, st: StateSpec, count: int) -> MixerCost:
    D, H, dt = spec.hidden_size, spec.num_heads, spec.dtype_bytes
    if st.kind == "linear":
        la = spec.linear
        state_flops = 7 * la.num_v_heads * la.k_head_dim * la.v_head_dim  # decay, read, update, output
        conv_flops = 2 * la.conv_dim * la.conv_kernel
        d1, d2 = la.conv_dim + 2 * la.num_v_heads, la.value_dim
        # chunked prefill: per token, its rows of the chunk's triangular systems and products, and the
        # state update spread over the chunk
        chunk_flops = la.num_v_heads * (2 * CHUNK * (3 * la.k_head_dim + 2 * la.v_head_dim) + 6 * la.k_head_dim * la.v_head_dim)
        Hv, dk, dv, C = la.num_v_heads, la.k_head_dim, la.v_head_dim, CHUNK
        # core.model.linear_attention.prefill's arrays: projections, outputs and fp32 gated norm a token; per
        # prompt its conv, q/k/v and gates; fp32 chunk systems (decay, A, scores) and sixteen [tokens, d] arrays
        return MixerCost(count, "linear", st, pre_params=D * (la.conv_dim + la.value_dim + 2 * la.num_v_heads),
                         post_params=la.value_dim * D, d1=d1, d2=d2, ctx_flops=0.0, query_flops=conv_flops + state_flops,
                         query_elems=d1 + d2, prefill_tok_flops=conv_flops + chunk_flops, pair_flops=0.0,
                         pf_tok=(d1 + 3 * la.value_dim + D) * dt + 4 * 4 * la.value_dim,
                         pf_seq=3 * la.conv_dim * dt + 4 * (Hv * (2 * dk + dv) + 2 * Hv),
                         pf_chunk=4 * Hv * (3 * C + 16 * max(dk, dv)) + 4 * C)
    if st.kind == "latent":
        m = spec.mla
        R, dr, qk = m.kv_lora_rank, m.qk_rope_dim, m.qk_nope_dim + m.qk_rope_dim
        q_params = D * m.q_lora_rank + m.q_lora_rank * H * qk if m.q_lora_rank else D * H * qk
        width = R + dr
        # core.model.mla.prefill's arrays a token: q and its latent, the KV latent, K and V expanded from it, the
        # outputs and the O projection; per prompt its fp32 scores
        pf_tok = (dt * (3 * H * qk + H * (m.qk_nope_dim + m.v_head_dim) + H * qk + 4 * width + 2 * H * m.v_head_dim + D
                        + 2 * m.q_lora_rank) + 4 * 2 * (R + m.q_lora_rank))
        return MixerCost(count, "mla", st, pre_params=q_params + D * width + H * m.qk_nope_dim * R,
                         post_params=H * R * m.v_head_dim + H * m.v_head_dim * D, d1=(H + 1) * width, d2=H * R,
                         ctx_flops=4 * H * width, query_flops=0.0, query_elems=2 * H * width,
                         # prefill expands K and V from the latent, then attends with full heads
                         prefill_tok_flops=2 * R * H * (m.qk_nope_dim + m.v_head_dim),
                         pair_flops=2 * H * (qk + m.v_head_dim), pf_tok=pf_tok, pf_pair=4 * H)
    q, kv = spec.q_size, spec.kv_size
    gate = q if spec.attn_gate else 0
    # core.model.gqa.prefill: the larger of the fp32 input norm and the QKV phase a token; per prompt its fp32
    # scores, block by block (held twice, and once in the weights' dtype, in the explicit form of sinks/windows)
    explicit = spec.attn_sinks or bool(st.window)
    pf_tok = max(D * (8 + dt), D * dt + 3 * (q + kv) * dt + 2 * gate * dt)
    return MixerCost(count, "gqa", st, pre_params=D * (q * (2 if spec.attn_gate else 1) + 2 * kv),
                     post_params=q * D, d1=q + 2 * kv, d2=q, ctx_flops=4 * q, query_flops=0.0, query_elems=2 * q,
                     prefill_tok_flops=0.0, pair_flops=4 * q, pf_tok=pf_tok,
                     pf_pair=(2 * 4 + dt) * H if explicit else 4 * H, heads=H, pf_blocked=explicit)
