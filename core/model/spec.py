"""ModelSpec: what mlight needs to know about an MoE checkpoint, derived from its config.json.

One frozen dataclass for every family. Family quirks are fields (norm kind, q/k norm, clip_qkv,
router normalisation, shared expert) so that the forward pass lives once in `core`; the per-family
modules in `core.model.families` only translate a config and name the weights.

Canonical per-layer tensors (all families are laid out this way at load time):
  ln1, ln2 [D]; qkv [(Hq+2·Hkv)·hd, D] (+ qkv_bias); q_norm/k_norm [hd] or [H·hd]; o [D, Hq·hd];
  router [E, D]; w13 [E, 2I, D] (gate rows, then up rows); w2 [E, D, I];
  shared_w13 [2Is, D], shared_w2 [D, Is], shared_gate [1, D] when the family has a shared expert.
Legend: D = hidden, E = experts, I = expert intermediate, Is = shared intermediate, hd = head dim.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Literal

# Bytes per element of the dtypes a checkpoint may use. torch is imported only where a tensor dtype
# is needed, so planning (`mlight plan`) stays quick to start.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)

EXPERT_TENSORS = ("w13", "w2")


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # the config's `architectures[0]`, e.g. "MixtralForCausalLM"
    family: str  # registry key of the family module, e.g. "mixtral"
    num_layers: int
    hidden_size: int  # D
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv (GQA when < Hq)
    head_dim: int  # hd
    vocab_size: int
    num_experts: int  # E
    top_k: int  # experts per token
    expert_intermediate: int  # I
    shared_intermediate: int = 0  # Is; 0 = no shared expert
    shared_gate: bool = False  # sigmoid gate on the shared expert's output (Qwen2-MoE)
    norm: Literal["rms", "layernorm"] = "rms"  # DBRX: LayerNorm without bias
    norm_eps: float = 1e-5
    qk_norm: Literal["none", "head", "full"] = "none"  # Qwen3: per head; OLMoE: over all heads
    qkv_bias: bool = False
    clip_qkv: float | None = None  # DBRX, OLMoE: clamp q, k, v to ±clip_qkv
    router_norm: Literal["none", "sum", "pnorm"] = "sum"  # renormalise the top-k probabilities
    router_pnorm: float = 1.0  # DBRX's moe_normalize_expert_weights
    router_softmax_fp32: bool = True  # DBRX keeps the softmax in the weights' dtype
    rope_theta: float = 10000.0
    max_position: int = 4096
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"  # checkpoint dtype, a key of DTYPES
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

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

    # ---- derived shapes -------------------------------------------------------------------------
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

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical tensors of one decoder layer, in their order in the layer's flat buffer."""
        D, E, I, hd = self.hidden_size, self.num_experts, self.expert_intermediate, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "ln1": (D,),
            "qkv": (self.q_size + 2 * self.kv_size, D),
        }
        if self.qkv_bias:
            shapes["qkv_bias"] = (self.q_size + 2 * self.kv_size,)
        if self.qk_norm == "head":
            shapes["q_norm"], shapes["k_norm"] = (hd,), (hd,)
        elif self.qk_norm == "full":
            shapes["q_norm"], shapes["k_norm"] = (self.q_size,), (self.kv_size,)
        shapes["o"] = (D, self.q_size)
        shapes["ln2"] = (D,)
        shapes["router"] = (E, D)
        if self.shared_intermediate:
            Is = self.shared_intermediate
            shapes["shared_w13"] = (2 * Is, D)
            shapes["shared_w2"] = (D, Is)
            if self.shared_gate:
                shapes["shared_gate"] = (1, D)
        shapes["w13"] = (E, 2 * I, D)
        shapes["w2"] = (E, D, I)
        return shapes

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {"embed": (self.vocab_size, self.hidden_size), "norm": (self.hidden_size,)}
        if not self.tie_word_embeddings:
            shapes["lm_head"] = (self.vocab_size, self.hidden_size)
        return shapes

    # ---- sizes (bytes in the checkpoint dtype) ----------------------------------------------------
    @property
    def expert_bytes(self) -> int:
        """One routed expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.expert_intermediate * self.dtype_bytes

    @property
    def layer_expert_bytes(self) -> int:
        return self.num_experts * self.expert_bytes

    @property
    def layer_nonexpert_bytes(self) -> int:
        return sum(_numel(s) for n, s in self.layer_shapes().items() if n not in EXPERT_TENSORS) * self.dtype_bytes

    @property
    def layer_bytes(self) -> int:
        return self.layer_nonexpert_bytes + self.layer_expert_bytes

    @property
    def global_bytes(self) -> int:
        return sum(_numel(s) for s in self.global_shapes().values()) * self.dtype_bytes

    @property
    def nonexpert_bytes(self) -> int:
        """Everything but the routed experts: attention, norms, routers, shared experts, embeddings."""
        return self.num_layers * self.layer_nonexpert_bytes + self.global_bytes

    @property
    def total_expert_bytes(self) -> int:
        return self.num_layers * self.layer_expert_bytes

    @property
    def total_bytes(self) -> int:
        return self.nonexpert_bytes + self.total_expert_bytes

    @property
    def num_params(self) -> int:
        return self.total_bytes // self.dtype_bytes

    @property
    def active_params(self) -> int:
        """Parameters one token touches: everything but the experts it is not routed to."""
        unused = self.num_layers * (self.num_experts - self.top_k) * self.expert_bytes
        return (self.total_bytes - unused) // self.dtype_bytes

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.kv_size * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return self.num_layers * self.kv_bytes_per_token_layer

    # ---- serialisation --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelSpec":
        return cls.from_dict(json.loads(text))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
