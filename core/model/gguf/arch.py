"""GGUF architectures as our families: the config a family module reads, and where each tensor goes. Mixtral files
say "llama"; their converter permuted q and k rows for llama.cpp's RoPE, which `unpermute` reverses (whole rows).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import UnsupportedModelError
from core.model import kernels
from core.model.families._common import having
from core.model.gguf.files import GGUFModel

# GGUF architecture -> the transformers architecture our family registry knows
ARCHS = {"llama": "MixtralForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
         "olmoe": "OlmoeForCausalLM", "gpt-oss": "GptOssForCausalLM", "deepseek2": "DeepseekV2ForCausalLM"}


def config(g: GGUFModel) -> dict:
    """A transformers-style config.json for our family modules, from the GGUF metadata and tensor shapes."""
    arch, m = g.arch, g.arch_meta
    hf = ARCHS.get(arch) if arch != "llama" or m("expert_count") else None  # a dense Llama is no mixture of experts
    if hf is None:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported"
                                    + (" (a dense model: mlight runs mixtures of experts)" if arch == "llama" else ""),
                                    f"mlight reads GGUF files of these architectures: {', '.join(sorted(ARCHS))}")
    tokens = g.meta("tokenizer.ggml.tokens") or []
    heads = int(m("attention.head_count"))
    D = int(m("embedding_length"))
    b = f"blk.{int(m('leading_dense_block_count', 0))}."  # the first MoE layer (DeepSeek's first ones are dense)
    gate = g.tensors.get(b + "ffn_gate_exps.weight") or g.tensors.get(b + "ffn_gate.0.weight")
    inter = gate.shape[-2] if gate is not None else int(m("expert_feed_forward_length") or m("feed_forward_length"))
    cfg = {
        "architectures": [hf],
        "hidden_size": D,
        "num_hidden_layers": int(m("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m("attention.head_count_kv", heads)),
        "head_dim": int(m("attention.key_length") or m("rope.dimension_count") or D // heads),
        "rms_norm_eps": float(m("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(m("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(m("context_length", 4096)),
        "vocab_size": int(m("vocab_size") or len(tokens) or g.tensors["token_embd.weight"].shape[0]),
        "num_experts_per_tok": int(m("expert_used_count")),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        # the reference reading (MLIGHT_KERNELS=torch) computes in float32: transformers' dequantized reading
        "torch_dtype": "float32" if kernels.reference() else "bfloat16",
        "bos_token_id": g.meta("tokenizer.ggml.bos_token_id"),
        "eos_token_id": g.meta("tokenizer.ggml.eos_token_id"),
    }
    scaling = m("rope.scaling.type")
    if scaling and scaling != "none":  # read, so that a family without it refuses the file rather than misread it
        cfg["rope_scaling"] = {"rope_type": scaling, "rope_theta": cfg["rope_theta"],
                               "factor": float(m("rope.scaling.factor", 1.0)),
                               "original_max_position_embeddings": int(m("rope.scaling.original_context_length", 0))}
    E = int(m("expert_count"))
    if hf == "MixtralForCausalLM":
        cfg.update(num_local_experts=E, intermediate_size=inter)
    else:
        cfg.update(num_experts=E, moe_intermediate_size=inter, intermediate_size=inter)
    if hf == "Qwen3MoeForCausalLM":
        cfg["norm_topk_prob"] = True  # llama.cpp always renormalises Qwen3-MoE's top-k weights
    if hf == "Qwen2MoeForCausalLM":
        shared = g.tensors.get("blk.0.ffn_up_shexp.weight")
        cfg.update(shared_expert_intermediate_size=shared.shape[0] if shared else 0, norm_topk_prob=False,
                   qkv_bias="blk.0.attn_q.bias" in g.tensors)
    if hf == "OlmoeForCausalLM":
        cfg.update(norm_topk_prob=False, clip_qkv=None)
    if hf == "DeepseekV2ForCausalLM":
        cfg.update(_mla_config(g, E, inter))
        log_mul = m("rope.scaling.yarn_log_multiplier")
        if log_mul and "rope_scaling" in cfg:  # llama.cpp keeps 0.1 · mscale_all_dim and takes mscale equal to it
            cfg["rope_scaling"].update(mscale=float(log_mul) / 0.1, mscale_all_dim=float(log_mul) / 0.1)
    return cfg


def _mla_config(g: GGUFModel, experts: int, inter: int) -> dict:
    """DeepSeek-V2's latent attention, dense first layers, shared experts and group-limited routing."""
    m = g.arch_meta
    if int(m("expert_gating_func", 1)) != 1:  # 2: sigmoid, DeepSeek-V3's router
        raise UnsupportedModelError("GGUF deepseek2 files with sigmoid expert gating (DeepSeek-V3) are not supported",
                                    "use a DeepSeek-V2 GGUF, or the model's safetensors checkpoint")
    rope, key = int(m("rope.dimension_count")), int(m("attention.key_length"))
    groups = int(m("expert_group_count", 1))
    return dict(q_lora_rank=int(m("attention.q_lora_rank", 0)) or None, kv_lora_rank=int(m("attention.kv_lora_rank")),
               qk_rope_head_dim=rope, qk_nope_head_dim=key - rope, v_head_dim=int(m("attention.value_length")),
               n_routed_experts=experts, moe_intermediate_size=inter, n_shared_experts=int(m("expert_shared_count", 0)),
               first_k_dense_replace=int(m("leading_dense_block_count", 0)),
               intermediate_size=int(m("feed_forward_length")),
               routed_scaling_factor=float(m("expert_weights_scale", 1.0)),
               n_group=groups, topk_group=int(m("expert_group_used_count", groups)),
               topk_method="group_limited_greedy" if groups > 1 else "greedy")


@dataclass(frozen=True)
class Place:
    """GGUF tensor `src` goes to canonical tensor `dest`, rows [lo, hi) (None: all of it)."""
    src: str
    dest: str
    rows: tuple[int, int] | None = None
    unpermute: int = 0  # heads whose rows llama.cpp's converter interleaved (0: none)
    unsqueeze: bool = False  # a 1-D GGUF tensor for a [1, D] canonical one


def dense_places(spec, i: int, names: set[str]) -> list[Place]:
    """Layer i's tensors but its routed experts (see families._common.having)."""
    p = f"blk.{i}."
    q, kv = spec.q_size, spec.kv_size
    rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
    permuted = {"q": spec.num_heads, "k": spec.num_kv_heads} if spec.family == "mixtral" else {}
    return having(spec, i, [
        Place(p + "attn_norm.weight", "ln1"), Place(p + "ffn_norm.weight", "ln2"),
        *(Place(f"{p}attn_{n}.weight", "qkv", r, permuted.get(n, 0)) for n, r in rows.items()),
        Place(p + "attn_output.weight", "o"), *(Place(f"{p}attn_{n}.bias", "qkv_bias", r) for n, r in rows.items()),
        Place(p + "attn_q_norm.weight", "q_norm"), Place(p + "attn_k_norm.weight", "k_norm"),
        # DeepSeek-V2's latent attention (kv_b whole, or from split k_b / v_b: gguf.load)
        Place(p + "attn_q_a.weight", "q_a"), Place(p + "attn_q_a_norm.weight", "q_a_norm"),
        Place(p + "attn_q_b.weight", "q_b"), Place(p + "attn_q.weight", "q"),
        Place(p + "attn_kv_a_mqa.weight", "kv_a"), Place(p + "attn_kv_a_norm.weight", "kv_a_norm"),
        Place(p + "attn_kv_b.weight", "kv_b"),
        *_mlp_places(p, "", "dense", spec.dense_intermediate), Place(p + "ffn_gate_inp.weight", "router"),
        *_mlp_places(p, "_shexp", "shared", spec.shared_intermediate),
        Place(p + "ffn_gate_inp_shexp.weight", "shared_gate", unsqueeze=True)])


def _mlp_places(p: str, tag: str, dest: str, inter: int) -> list[Place]:
    return [Place(f"{p}ffn_gate{tag}.weight", f"{dest}_w13", (0, inter)),
            Place(f"{p}ffn_up{tag}.weight", f"{dest}_w13", (inter, 2 * inter)),
            Place(f"{p}ffn_down{tag}.weight", f"{dest}_w2")]


def expert_sources(i: int, names: set[str], experts: int) -> dict[str, list[str]]:
    """gate / up / down -> their GGUF tensor(s): one stacked [E, ...], or one per expert (older files)."""
    stacked = {w: f"blk.{i}.ffn_{w}_exps.weight" for w in ("gate", "up", "down")}
    return {w: [s] if s in names else [f"blk.{i}.ffn_{w}.{e}.weight" for e in range(experts)]
            for w, s in stacked.items()}


def global_places(spec) -> list[Place]:
    shapes = spec.global_shapes()
    return [p for p in (Place("token_embd.weight", "embed"), Place("output_norm.weight", "norm"),
                        Place("output.weight", "lm_head")) if p.dest in shapes]


def unpermute(rows, heads: int):
    """Undo the converter's q/k row order: per head, (2, hd/2) interleaved back to (hd/2, 2)."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)
