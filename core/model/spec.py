"""ModelSpec: what mlight needs to know about an MoE checkpoint, from its config.json. One frozen dataclass for
every family, quirks as fields, so the forward pass lives once in `core` and the family modules only translate a
config and name the weights. The canonical per-layer tensors are `layer_shapes`' (w13: gate rows, then up rows;
lin_in: rows q, k, v, z, b, a). Legend: D = hidden, E = experts, I = expert intermediate, Is = shared intermediate,
Id = dense intermediate, hd = head dim, R = KV latent rank, dn/dr/dv = MLA no-rope/rope/value head dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

# torch is imported only where a tensor dtype is needed, so that `mlight plan` starts quickly
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
STATE_DTYPE_BYTES = 4  # linear-attention recurrent states are kept in fp32, as the reference does


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


EXPERT_TENSORS = ("w13", "b13", "w2", "b2")
LAYER_TYPES = ("full", "sliding", "linear")


def _present(shapes: dict) -> dict[str, tuple[int, ...]]:
    """The tensors a layer has: those whose shape is not a false condition (False, 0, None)."""
    return {name: shape for name, shape in shapes.items() if shape}


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding: frequencies, how much of a head it rotates, and its scaling."""

    theta: float = 10000.0
    dim: int = 0  # rotated dims of a head (partial rotary); 0 = the whole rope part of the head
    pairs: bool = False  # rotate interleaved pairs (x0, x1), (x2, x3)… (DeepSeek) instead of halves
    kind: Literal["default", "yarn", "longrope"] = "default"
    factor: float = 1.0
    original_max: int = 0  # pre-training context (YaRN, LongRoPE)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # scale on cos/sin; None: derived as the reference does
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    short_mscale: float | None = None
    long_mscale: float | None = None


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek's multi-head latent attention: low-rank Q and a compressed KV latent."""

    q_lora_rank: int  # Rq; 0 = a full-rank q projection
    kv_lora_rank: int  # R
    qk_nope_dim: int  # dn
    qk_rope_dim: int  # dr
    v_head_dim: int  # dv


@dataclass(frozen=True)
class LinearAttnSpec:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): a per-sequence recurrent state instead of a KV cache."""

    num_k_heads: int  # Hk
    num_v_heads: int  # Hv (a multiple of Hk)
    k_head_dim: int  # dk
    v_head_dim: int  # dv
    conv_kernel: int  # K

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class StateSpec:
    """What one layer keeps per sequence, in elements: K and V of every token ("kv") or of the last `window`,
    MLA's latent and rope key per token, or a fixed fp32 recurrent state and a conv state ("linear")."""

    kind: Literal["kv", "window", "latent", "linear"]
    token_elems: int = 0  # per cached token, model dtype
    window: int = 0  # "window": tokens kept at most
    fixed_elems: int = 0  # per sequence, model dtype (conv state)
    fixed_state_elems: int = 0  # per sequence, fp32 (recurrent state)

    def tokens_kept(self, tokens: float) -> float:
        return min(tokens, self.window) if self.window else tokens

    def bytes(self, tokens: float, dtype_bytes: int) -> float:
        return (self.token_elems * self.tokens_kept(tokens) + self.fixed_elems) * dtype_bytes \
            + self.fixed_state_elems * STATE_DTYPE_BYTES


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # the config's `architectures[0]`, e.g. "MixtralForCausalLM"
    family: str  # registry key of the family module, e.g. "mixtral"
    num_layers: int
    hidden_size: int  # D
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv (GQA when < Hq)
    head_dim: int  # hd (MLA: dn + dr)
    vocab_size: int
    num_experts: int  # E
    top_k: int  # experts per token
    expert_intermediate: int  # I
    shared_intermediate: int = 0  # Is; 0 = no shared expert
    shared_gate: bool = False  # sigmoid gate on the shared expert's output (Qwen2-MoE, Qwen3-Next)
    norm: Literal["rms", "rms_fp32", "rms_offset", "layernorm"] = "rms"  # rms_fp32: weight applied in fp32
    # (gpt-oss); rms_offset: x·(1 + w) in fp32 (Qwen3-Next); layernorm: DBRX (no bias), Phi (bias)
    norm_bias: bool = False
    norm_eps: float = 1e-5
    qk_norm: Literal["none", "head", "full"] = "none"  # Qwen3: per head; OLMoE: over all heads
    qkv_bias: bool = False
    clip_qkv: float | None = None  # DBRX, OLMoE: clamp q, k, v to ±clip_qkv
    router: Literal["softmax", "topk_softmax", "softmax_group", "sigmoid_group", "sparsemixer"] = "softmax"
    router_norm: Literal["none", "sum", "pnorm"] = "sum"  # renormalise the top-k probabilities
    router_pnorm: float = 1.0  # DBRX's moe_normalize_expert_weights
    router_softmax_fp32: bool = True  # DBRX keeps the softmax in the weights' dtype
    router_fp32: bool = False  # DeepSeek, GLM: router logits computed in fp32
    router_bias: bool = False  # gpt-oss: a bias on the router logits
    router_correction: bool = False  # V3, GLM: e_score_correction_bias chooses, the plain score weighs
    router_groups: int = 1  # group-limited routing: experts in n_group groups,
    router_topk_groups: int = 1  # of which the top topk_group groups are eligible
    routed_scale: float = 1.0  # routed_scaling_factor on the expert weights
    router_jitter: float = 0.0  # sparsemixer's jitter_eps (inference form: a threshold, no noise)
    expert_bias: bool = False  # gpt-oss: biases on the experts' projections
    expert_act: Literal["swiglu", "clamped_swiglu"] = "swiglu"  # gpt-oss: clamped, α-sigmoid, (up + 1)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    dense_layers: tuple[int, ...] = ()  # layers whose FFN is a dense MLP (DeepSeek's first_k_dense_replace)
    dense_intermediate: int = 0  # Id
    layer_types: tuple[str, ...] = ()  # per layer, a LAYER_TYPES name; () = every layer "full"
    sliding_window: int = 0  # tokens a "sliding" layer sees, its own included
    attn_sinks: bool = False  # gpt-oss: a learned per-head logit in every softmax's denominator
    attn_o_bias: bool = False
    attn_gate: bool = False  # Qwen3-Next: attention output × sigmoid(a second half of q_proj)
    attn_scale: float = 0.0  # softmax scale; 0 = head_dim ** -0.5
    mla: MLASpec | None = None
    linear: LinearAttnSpec | None = None
    rope: RopeSpec = RopeSpec()
    max_position: int = 4096
    tie_word_embeddings: bool = False
    lm_head_bias: bool = False
    dtype: str = "bfloat16"  # checkpoint dtype, a key of DTYPES
    quant_method: str | None = None  # the checkpoint's quantization_config.quant_method (mxfp4, fp8, …)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # how the routed experts are stored (core.model.quant): "none" = in `dtype`; else a label such as
    # "int8", "int4-g64", "Q4_K/Q6_K", with `expert_bits` the bits per weight including scales
    expert_format: str = "none"
    expert_bits: float = 0.0
    # the dense weights the CPU-only mode holds in a weight-only format (--quantize-dense): a Format label
    # ("int8", "int4-g64") or "none"; which ones and their bytes: core.model.quant.dense_spec
    dense_format: str = "none"

    def __post_init__(self):
        positive = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                    "num_experts", "top_k", "expert_intermediate")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelSpec.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers, the model has {self.num_layers}")
        if bad := [t for t in self.layer_types if t not in LAYER_TYPES]:
            raise ValueError(f"unknown layer type {bad[0]!r}; expected one of {LAYER_TYPES}")
        if "sliding" in self.layer_types and self.sliding_window <= 0:
            raise ValueError("sliding layers need a positive sliding_window")
        if "linear" in self.layer_types and self.linear is None:
            raise ValueError("linear-attention layers need the linear-attention dimensions")
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ValueError(f"dense_layers {self.dense_layers} name layers outside 0..{self.num_layers - 1}")
        if self.dense_layers and self.dense_intermediate <= 0:
            raise ValueError("dense MLP layers need a positive dense_intermediate")
        if self.router_groups < 1 or self.num_experts % self.router_groups:
            raise ValueError(f"{self.num_experts} experts do not split into {self.router_groups} routing groups")
        if not 1 <= self.router_topk_groups <= self.router_groups:
            raise ValueError(f"topk_group {self.router_topk_groups} must lie in 1..n_group {self.router_groups}")

    @property
    def torch_dtype(self):
        return torch_dtype(self.dtype)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    @property
    def rope_dim(self) -> int:
        """Dims RoPE rotates in a query/key head (a partial share, the rope part of a latent head, or all of it)."""
        return self.rope.dim or (self.mla.qk_rope_dim if self.mla else self.head_dim)

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full"

    def is_moe(self, i: int) -> bool:
        return i not in self.dense_layers

    @property
    def moe_layers(self) -> int:
        return self.num_layers - len(set(self.dense_layers))

    def attn_shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        D, hd = self.hidden_size, self.head_dim
        if self.layer_type(i) == "linear":
            la = self.linear
            return {"lin_in": (la.conv_dim + la.value_dim + 2 * la.num_v_heads, D), "conv": (la.conv_dim, la.conv_kernel),
                    "dt_bias": (la.num_v_heads,), "A_log": (la.num_v_heads,), "gnorm": (la.v_head_dim,),
                    "lin_out": (D, la.value_dim)}
        if self.mla is not None:
            m, H = self.mla, self.num_heads
            qk = m.qk_nope_dim + m.qk_rope_dim
            shapes = ({"q_a": (m.q_lora_rank, D), "q_a_norm": (m.q_lora_rank,), "q_b": (H * qk, m.q_lora_rank)}
                      if m.q_lora_rank else {"q": (H * qk, D)})
            shapes.update({"kv_a": (m.kv_lora_rank + m.qk_rope_dim, D), "kv_a_norm": (m.kv_lora_rank,),
                           "kv_b": (H * (m.qk_nope_dim + m.v_head_dim), m.kv_lora_rank), "o": (D, H * m.v_head_dim)})
            return shapes
        rows = self.q_size * (2 if self.attn_gate else 1) + 2 * self.kv_size
        qk_norm = {"head": ((hd,), (hd,)), "full": ((self.q_size,), (self.kv_size,))}.get(self.qk_norm, (None, None))
        return _present({"qkv": (rows, D), "qkv_bias": self.qkv_bias and (rows,), "q_norm": qk_norm[0],
                         "k_norm": qk_norm[1], "o": (D, self.q_size), "o_bias": self.attn_o_bias and (D,),
                         "sinks": self.attn_sinks and (self.num_heads,)})

    def ffn_shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        D, E, I, Is = self.hidden_size, self.num_experts, self.expert_intermediate, self.shared_intermediate
        if not self.is_moe(i):
            Id = self.dense_intermediate
            return {"dense_w13": (2 * Id, D), "dense_w2": (D, Id)}
        return _present({"router": (E, D), "router_bias": self.router_bias and (E,),
                         "e_bias": self.router_correction and (E,), "shared_w13": Is and (2 * Is, D),
                         "shared_w2": Is and (D, Is), "shared_gate": Is and self.shared_gate and (1, D),
                         "w13": (E, 2 * I, D), "b13": self.expert_bias and (E, 2 * I),
                         "w2": (E, D, I), "b2": self.expert_bias and (E, D)})

    def layer_shapes(self, i: int = 0) -> dict[str, tuple[int, ...]]:
        """Canonical tensors of decoder layer i, in their order in the layer's flat buffer (experts last)."""
        D, bias = self.hidden_size, self.norm_bias
        return _present({"ln1": (D,), "ln1_b": bias and (D,), **self.attn_shapes(i), "ln2": (D,),
                         "ln2_b": bias and (D,), **self.ffn_shapes(i)})

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        D, V = self.hidden_size, self.vocab_size
        return _present({"embed": (V, D), "norm": (D,), "norm_b": self.norm_bias and (D,),
                         "lm_head": not self.tie_word_embeddings and (V, D), "lm_head_b": self.lm_head_bias and (V,)})

    def layer_state(self, i: int) -> StateSpec:
        kind = self.layer_type(i)
        if kind == "linear":
            la = self.linear
            return StateSpec("linear", fixed_elems=la.conv_dim * (la.conv_kernel - 1),
                             fixed_state_elems=la.num_v_heads * la.k_head_dim * la.v_head_dim)
        if self.mla is not None:
            return StateSpec("latent", token_elems=self.mla.kv_lora_rank + self.mla.qk_rope_dim)
        if kind == "sliding":
            return StateSpec("window", token_elems=2 * self.kv_size, window=self.sliding_window)
        return StateSpec("kv", token_elems=2 * self.kv_size)

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (with its biases, where the family has them)."""
        D, I = self.hidden_size, self.expert_intermediate
        return 3 * D * I + (2 * I + D if self.expert_bias else 0)

    @property
    def expert_bytes(self) -> int:
        """One routed expert's projections in their storage format, biases in the checkpoint dtype."""
        weights = 3 * self.hidden_size * self.expert_intermediate
        bias = (self.expert_params - weights) * self.dtype_bytes
        return (math.ceil(weights * self.expert_bits / 8) if self.expert_bits else weights * self.dtype_bytes) + bias

    @property
    def layer_expert_bytes(self) -> int:
        return self.num_experts * self.expert_bytes

    @property
    def layer_nonexpert_bytes(self) -> int:
        """The non-expert tensors of a decoder layer, averaged over the layers."""
        return (self.nonexpert_bytes - self.global_bytes) // self.num_layers

    @property
    def global_bytes(self) -> int:
        return sum(math.prod(s) for s in self.global_shapes().values()) * self.dtype_bytes

    @property
    def nonexpert_bytes(self) -> int:
        """Everything but the routed experts: attention, norms, routers, shared experts, dense MLPs, embeddings."""
        return sum(math.prod(s) for i in range(self.num_layers) for n, s in self.layer_shapes(i).items()
                   if n not in EXPERT_TENSORS) * self.dtype_bytes + self.global_bytes

    @property
    def total_expert_bytes(self) -> int:
        return self.moe_layers * self.layer_expert_bytes

    @property
    def total_bytes(self) -> int:
        return self.nonexpert_bytes + self.total_expert_bytes

    @property
    def num_params(self) -> int:
        return self.nonexpert_bytes // self.dtype_bytes + self.moe_layers * self.num_experts * self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token touches: everything but the experts it is not routed to."""
        return self.num_params - self.moe_layers * (self.num_experts - self.top_k) * self.expert_params

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one more token adds over all layers once windows are full (full-attention and latent layers)."""
        return sum(s.token_elems for s in map(self.layer_state, range(self.num_layers))
                   if s.kind in ("kv", "latent")) * self.dtype_bytes

    def state_bytes(self, tokens: float) -> float:
        """Bytes one sequence of `tokens` tokens keeps over all layers."""
        return sum(self.layer_state(i).bytes(tokens, self.dtype_bytes) for i in range(self.num_layers))
