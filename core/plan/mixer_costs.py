"""FLOPs and bytes of each token-mixer kind, per layer, for the HRM.

A model's layers come in groups of one kind (core.model.mixer): grouped-query attention over the
whole context or a sliding window, MLA over a latent cache (absorbed at decode, expanded at
prefill), Gated DeltaNet over a fixed recurrent state. `mixer_costs(spec)` gives one `MixerCost`
per group; core.plan.hrm averages them over the layers, so an "average layer" costs what the real
mix of layers costs. What a sequence keeps is the layer's StateSpec (core.model.spec).
Boundary: arithmetic on ModelSpec numbers; no torch, no rates.
Legend: t = query tokens, c = cached tokens (context), s = prompt tokens, D = hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.model.spec import ModelSpec, StateSpec

CHUNK = 64  # Gated DeltaNet's prefill chunk (core.model.linear_attention.CHUNK)


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

    def decode(self, t: float, c: float, dt: int) -> tuple[float, float]:
        """(FLOPs, bytes) of attention for t new tokens, each over a context of c tokens."""
        kept = self.state.tokens_kept(c)
        state_bytes = self.state.bytes(c, dt)
        if self.kind == "linear":  # the state is read and written back, once per token
            state_bytes *= 2
        return t * (kept * self.ctx_flops + self.query_flops), t * (state_bytes + self.query_elems * dt)

    def prefill(self, seqs: float, s: float, dt: int) -> tuple[float, float]:
        """(FLOPs, bytes) of `seqs` prompts of s tokens (causal; a window caps the visible keys)."""
        w = self.state.window
        pairs = s * (s + 1) / 2 if not w or s <= w else w * (w + 1) / 2 + (s - w) * w
        if self.kind == "linear":
            pairs = 0.0
        return seqs * (pairs * self.pair_flops + s * self.prefill_tok_flops), seqs * s * (self.d1 + self.d2) * dt

    def new_token_bytes(self, dt: int) -> float:
        """Bytes of state one decode token writes back (its K/V or latent; a linear layer's whole state)."""
        if self.kind == "linear":
            return self.state.bytes(0, dt)
        return self.state.token_elems * dt


def mixer_costs(spec: ModelSpec) -> tuple[MixerCost, ...]:
    groups: dict[tuple, list] = {}
    for i in range(spec.num_layers):
        st = spec.layer_state(i)
        key = (st.kind, st.window)
        groups.setdefault(key, [0, st])[0] += 1
    return tuple(_cost(spec, st, n) for n, st in groups.values())


def _cost(spec: ModelSpec, st: StateSpec, count: int) -> MixerCost:
    D, H = spec.hidden_size, spec.num_heads
    if st.kind == "linear":
        la = spec.linear
        state_flops = 7 * la.num_v_heads * la.k_head_dim * la.v_head_dim  # decay, read, update, output
        conv_flops = 2 * la.conv_dim * la.conv_kernel
        d1, d2 = la.conv_dim + 2 * la.num_v_heads, la.value_dim
        # chunked prefill: per token, its rows of the chunk's triangular systems and products, and the
        # state update spread over the chunk
        chunk_flops = la.num_v_heads * (2 * CHUNK * (3 * la.k_head_dim + 2 * la.v_head_dim) + 6 * la.k_head_dim * la.v_head_dim)
        return MixerCost(count, "linear", st, pre_params=D * (la.conv_dim + la.value_dim + 2 * la.num_v_heads),
                         post_params=la.value_dim * D, d1=d1, d2=d2, ctx_flops=0.0, query_flops=conv_flops + state_flops,
                         query_elems=d1 + d2, prefill_tok_flops=conv_flops + chunk_flops, pair_flops=0.0)
    if st.kind == "latent":
        m = spec.mla
        R, dr, qk = m.kv_lora_rank, m.qk_rope_dim, m.qk_nope_dim + m.qk_rope_dim
        q_params = D * m.q_lora_rank + m.q_lora_rank * H * qk if m.q_lora_rank else D * H * qk
        width = R + dr
        return MixerCost(count, "mla", st, pre_params=q_params + D * width + H * m.qk_nope_dim * R,
                         post_params=H * R * m.v_head_dim + H * m.v_head_dim * D, d1=(H + 1) * width, d2=H * R,
                         ctx_flops=4 * H * width, query_flops=0.0, query_elems=2 * H * width,
                         # prefill expands K and V from the latent, then attends with full heads
                         prefill_tok_flops=2 * R * H * (m.qk_nope_dim + m.v_head_dim),
                         pair_flops=2 * H * (qk + m.v_head_dim))
    q, kv = spec.q_size, spec.kv_size
    return MixerCost(count, "gqa", st, pre_params=D * (q * (2 if spec.attn_gate else 1) + 2 * kv),
                     post_params=q * D, d1=q + 2 * kv, d2=q, ctx_flops=4 * q, query_flops=0.0, query_elems=2 * q,
                     prefill_tok_flops=0.0, pair_flops=4 * q)
