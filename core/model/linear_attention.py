"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5) as CGOPipe runs it. Per sequence and value head: a
recurrent state S [dk, dv] (fp32) and the last K−1 conv inputs. For a token, x = silu(conv(mixed)) splits into
q, k [Hk, dk] (L2-normed, q scaled by dk^-½, shared by Hv/Hk value heads) and v [Hv, dv]; with
g = −exp(A_log)·softplus(a + dt_bias) and β = σ(b):
    S ← e^g·S;  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq
then o is RMS-normed per head, gated by silu(z) and projected out. `pre` projects (D1: conv input, b, a),
`attend` steps conv and recurrence next to the state (D2: o), `post` gates, norms and projects;
`prefill` scans chunks, not tokens (the UT transform), and returns the final states.
Legend: T = tokens, B = requests, L = prompt tokens, C = conv channels (2·Hk·dk + Hv·dv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.model.layers import normed
from core.model.limits import LINEAR_CHUNK as CHUNK  # the prefill's chunk (the planner counts its systems)
from core.model.spec import ModelSpec


def d1_width(spec: ModelSpec) -> int:
    return spec.linear.conv_dim + 2 * spec.linear.num_v_heads


def d2_width(spec: ModelSpec) -> int:
    return spec.linear.value_dim


def pre(spec: ModelSpec, w: dict, h: torch.Tensor, positions=None, rope=None, call_lengths=None, full_norm=None,
        out: torch.Tensor | None = None):
    """-> (payload [T, d1]: the conv input, b and a — joined into `out` when given — and z, which stays)."""
    la = spec.linear
    mixed, z, b, a = F.linear(h, w["lin_in"]).split([la.conv_dim, la.value_dim, la.num_v_heads, la.num_v_heads], dim=-1)
    return torch.cat((mixed, b, a), dim=-1, out=out), z


def _heads(spec: ModelSpec, x: torch.Tensor):
    """Conv output x [..., C] -> q, k [..., Hv, dk] (normalised, q scaled, expanded to the value heads), v [..., Hv, dv]."""
    la = spec.linear
    q, k, v = x.float().split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
    rep = la.num_v_heads // la.num_k_heads
    q = _l2norm(q.unflatten(-1, (la.num_k_heads, la.k_head_dim))).repeat_interleave(rep, dim=-2)
    k = _l2norm(k.unflatten(-1, (la.num_k_heads, la.k_head_dim))).repeat_interleave(rep, dim=-2)
    return q * la.k_head_dim ** -0.5, k, v.unflatten(-1, (la.num_v_heads, la.v_head_dim))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _gates(w: dict, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log decay g, rate β) in fp32 from the b and a projections [..., Hv]."""
    g = -w["A_log"].float().exp() * F.softplus(a.float() + w["dt_bias"])
    return g, torch.sigmoid(b).float()


def attend(spec: ModelSpec, w: dict, payload: torch.Tensor, store, rows, widen=None) -> torch.Tensor:
    """One token per row: conv step and fp32 recurrence over the rows' states. payload [B, d1] -> o [B, Hv·dv]."""
    la, B = spec.linear, rows.B
    mixed, b, a = payload.split([la.conv_dim, la.num_v_heads, la.num_v_heads], dim=-1)
    window = torch.cat((rows.take(store.conv), mixed[:, :, None].to(store.conv.dtype)), dim=-1)  # [B, C, K]
    rows.put(store.conv, window[:, :, 1:])
    conv_w = w["conv"]
    x = F.silu((window.to(conv_w.dtype) * conv_w).sum(dim=-1)).to(payload.dtype)
    q, k, v = _heads(spec, x)  # [B, Hv, dk], [B, Hv, dk], [B, Hv, dv]
    g, beta = _gates(w, b, a)
    state = rows.take(store.rec) * g.exp()[..., None, None]  # [B, Hv, dk, dv]
    delta = (v - torch.einsum("bhkv,bhk->bhv", state, k)) * beta[..., None]
    state.add_(k[..., :, None] * delta[..., None, :])
    rows.put(store.rec, state)
    o = torch.einsum("bhkv,bhk->bhv", state, q)
    return o.to(payload.dtype).reshape(B, la.value_dim)


def post(spec: ModelSpec, w: dict, out: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """o [T, Hv·dv], z [T, Hv·dv] -> norm each head, gate by silu(z), project [T, D]."""
    la = spec.linear
    o = out.view(-1, la.num_v_heads, la.v_head_dim)
    # the statistics in fp32, rounded to o's dtype, then the weight: the reference's roundings in one kernel
    gated = (w["gnorm"] * normed(o, None, spec.norm_eps)) * F.silu(keep.view_as(o).float())
    return F.linear(gated.to(out.dtype).reshape(out.shape[0], -1), w["lin_out"])


def prefill(spec: ModelSpec, w: dict, h: torch.Tensor, positions=None, rope=None, lens: list[int] = (),
            call_lengths=None, window: int = 0, full_norm=None):
    """Whole prompts in h [T, D] -> (output [T, D], per prompt its (recurrent, conv) states to store)."""
    la = spec.linear
    payload, z = pre(spec, w, h)
    mixed, b, a = payload.split([la.conv_dim, la.num_v_heads, la.num_v_heads], dim=-1)
    K = la.conv_kernel
    outs, parts, start = [], [], 0
    for n in lens:
        s = slice(start, start + n)
        x = mixed[s]  # [L, C]
        conv = F.conv1d(x.t()[None].to(w["conv"].dtype), w["conv"][:, None, :], padding=K - 1, groups=la.conv_dim)
        y = F.silu(conv[0, :, :n]).t().to(h.dtype)  # [L, C]
        q, k, v = _heads(spec, y)
        g, beta = _gates(w, b[s], a[s])
        o, state = chunked_delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                      g.t(), beta.t())
        outs.append(o.transpose(0, 1).to(h.dtype).reshape(n, la.value_dim))
        tail = x[max(0, n - (K - 1)):].t()  # the conv state: last K−1 inputs, zeros before the prompt
        parts.append((state, F.pad(tail, (K - 1 - tail.shape[1], 0))))
        start += n
    return post(spec, w, torch.cat(outs), z), parts


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor | None = None, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a sequence, chunk by chunk (fp32).

    q, k [H, L, dk]; v [H, L, dv]; g, beta [H, L]; state [H, dk, dv] or None (zeros) -> (o [H, L, dv], state).
    Within a chunk with cumulative log decay γ: (I + A)·U = β·V, (I + A)·W = β·K·e^γ, A[i, j] = β_i (k_i·k_j)
    e^(γ_i − γ_j) for j < i; V' = U − W·S, o = (q·e^γ)·S + ((q·kᵀ) ⊙ e^(γ_i − γ_j), j ≤ i)·V',
    S ← e^(γ_last)·S + (k·e^(γ_last − γ))ᵀ·V'."""
    H, L, dk = k.shape
    dv = v.shape[-1]
    pad = (-L) % chunk
    if pad:  # padded tokens have β = 0 and g = 0: they neither write nor decay the state
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (L + pad) // chunk
    q, k, v = (x.reshape(H, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(H, n, chunk), beta.reshape(H, n, chunk)
    gamma = g.cumsum(dim=-1)
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)  # j > i
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(later, float("-inf")).exp()  # j ≤ i
    kb = k * beta[..., None]
    a = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(eye + a, v * beta[..., None], upper=False, unitriangular=True)
    wk = torch.linalg.solve_triangular(eye + a, kb * gamma.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp()[..., None]
    last = gamma[..., -1:]
    k_decayed = k * (last - gamma).exp()[..., None]
    S = torch.zeros(H, dk, dv, dtype=q.dtype, device=q.device) if state is None else state.to(q.dtype).clone()
    out = torch.empty(H, n, chunk, dv, dtype=q.dtype, device=q.device)
    for i in range(n):
        v_new = u[:, i] - wk[:, i] @ S
        out[:, i] = q_decayed[:, i] @ S + attn[:, i] @ v_new
        S = S * last[:, i].exp()[..., None] + k_decayed[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, n * chunk, dv)[:, :L], S
