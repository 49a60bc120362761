"""GGUF test files written with the `gguf` package's writer from tiny random transformers checkpoints.

Tensors are named and laid out as llama.cpp's converter does (experts stacked [E, I, D], Mixtral's q/k
rows permuted for interleaved RoPE, the tokenizer and chat template in the metadata). Q8_0, Q4_0 and
MXFP4 blocks come from gguf's own quantizers; gguf has no K-quant quantizer, so Q4_K, Q5_K and Q6_K
blocks come from the small encoders here (plain min/max scales, not llama.cpp's search: any valid
blocks will do, the tests compare decoders with decoders).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from checkpoints import hf_model

GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "deepseek_v2": "deepseek2"}


# ---- K-quant encoders (blocks of 256) -------------------------------------------------------------
def _f16(x):
    return np.asarray(x, dtype=np.float16).reshape(-1, 1).view(np.uint8)


def _pack_scales_k4(sc, mn):
    """8 six-bit scales and mins per block -> the 12 bytes Q4_K / Q5_K keep them in."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def _kquant_affine(x, levels):
    """x [n, 256] -> (d, dmin fp16 [n], six-bit scales and mins [n, 8], q [n, 256] in 0..levels)."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / levels
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), 1, 63)
    mn = np.clip(np.round(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63)
    step = (d[:, None] * sc)[..., None]
    q = np.round((sub + (dmin[:, None] * mn)[..., None]) / np.where(step > 0, step, 1))
    q = np.clip(np.where(step > 0, q, 0), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q.reshape(-1, 256)


def q4_k(x):
    d, dmin, sc, mn, q = _kquant_affine(x, 15)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16(d), _f16(dmin), _pack_scales_k4(sc, mn), qs], 1)


def q5_k(x):
    d, dmin, sc, mn, q = _kquant_affine(x, 31)
    q = q.reshape(-1, 8, 32)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= ((q[:, j] >> 4) & 1) << j
    lo = (q & 15).reshape(-1, 4, 2, 32)
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16(d), _f16(dmin), _pack_scales_k4(sc, mn), qh, qs], 1)


def q6_k(x):
    sub = x.reshape(-1, 16, 16)
    amax = np.abs(sub).max(-1)
    scale = amax / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    step = (d[:, None] * sc.astype(np.float32))[..., None]
    q = (np.clip(np.round(sub / np.where(step != 0, step, 1)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    # per half: ql[0:32] = q1 | q3 << 4, ql[32:64] = q2 | q4 << 4 (low four bits); qh: the top two bits of each
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], -1)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16(d)], 1)


def quantize(x: np.ndarray, kind: str) -> np.ndarray:
    """float32 [..., K] -> GGUF bytes [..., K/block · type_size] of `kind`."""
    import gguf

    t = gguf.GGMLQuantizationType[kind]
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        bs, ts = gguf.GGML_QUANT_SIZES[t]
        enc = {"Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}[kind]
        return enc(x.reshape(-1, bs).astype(np.float32)).reshape(*x.shape[:-1], x.shape[-1] // bs * ts)
    if kind not in ("Q8_0", "Q4_0", "MXFP4", "Q4_1", "Q5_0", "Q5_1", "BF16"):  # no quantizer: bytes of the right size,
        bs, ts = gguf.GGML_QUANT_SIZES[t]  # for files that must be refused before their data is read
        return np.zeros((*x.shape[:-1], x.shape[-1] // bs * ts), dtype=np.uint8)
    return gguf.quants.quantize(x.astype(np.float32), t)


# ---- files ---------------------------------------------------------------------------------------------
def _permute(w, heads):
    """llama.cpp's converter order for q/k rows (what mlight's loader undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# transformers name -> llama.cpp name, for the tensors that only change name ({i} = layer)
NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"}
LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "mlp.gate.weight": "ffn_gate_inp.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight"}


# DeepSeek-V2 (llama.cpp's deepseek2): latent attention, dense MLP in the first layers, shared experts
MLA_NAMES = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
             "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
             "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
             "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight", "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
             "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
             "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight"}


def name_map(layers: int) -> dict[str, str]:
    out = dict(NAMES)
    for i in range(layers):
        out.update({f"model.layers.{i}.{h}": f"blk.{i}.{g}" for h, g in {**LAYER_NAMES, **MLA_NAMES}.items()})
    return out


def tensors_of(family: str, ckpt: Path, split_kv_b: bool = False) -> dict[str, np.ndarray]:
    """GGUF name -> float32 numpy tensor, in llama.cpp's names and layout. `split_kv_b`: DeepSeek's kv_b as
    newer converters write it, attn_k_b [H, R, dn] (each head transposed) and attn_v_b [H, dv, R]."""
    m = hf_model(ckpt)
    cfg = m.config
    sd = {k: v.detach().float().numpy() for k, v in m.state_dict().items()}
    out = {g: sd[h] for h, g in name_map(cfg.num_hidden_layers).items() if h in sd}
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        if split_kv_b:
            kv = out.pop(b + "attn_kv_b.weight").reshape(cfg.num_attention_heads, -1, cfg.kv_lora_rank)
            out[b + "attn_k_b.weight"] = np.ascontiguousarray(kv[:, :cfg.qk_nope_head_dim].transpose(0, 2, 1))
            out[b + "attn_v_b.weight"] = np.ascontiguousarray(kv[:, cfg.qk_nope_head_dim:])
        if family == "mixtral":
            out[b + "attn_q.weight"] = _permute(out[b + "attn_q.weight"], cfg.num_attention_heads)
            out[b + "attn_k.weight"] = _permute(out[b + "attn_k.weight"], cfg.num_key_value_heads)
        if p + "mlp.experts.gate_up_proj" not in sd:  # a dense layer
            continue
        gu = sd[p + "mlp.experts.gate_up_proj"]
        I = gu.shape[1] // 2
        out.update({b + "ffn_gate_exps.weight": np.ascontiguousarray(gu[:, :I]),
                    b + "ffn_up_exps.weight": np.ascontiguousarray(gu[:, I:]),
                    b + "ffn_down_exps.weight": sd[p + "mlp.experts.down_proj"]})
    return out


def q4_k_m(name: str, layer_count: int) -> str:
    """A Q4_K_M-like choice of type per tensor: Q4_K mostly, Q6_K for attn_v, the output, and the down
    projections of the first and last layers (llama.cpp's "use more bits" layers)."""
    if name.endswith("norm.weight") or "ffn_gate_inp" in name:
        return "F32"
    if name == "output.weight" or "attn_v" in name:
        return "Q6_K"
    if "ffn_down" in name:
        i = int(name.split(".")[1])
        return "Q6_K" if i in (0, layer_count - 1) else "Q4_K"
    return "Q4_K"


def write_gguf(family: str, ckpt: Path, out: Path, kinds, *, split_max_tensors: int = 0, extra=None,
               split_kv_b: bool = False) -> Path:
    """A GGUF of the checkpoint with each tensor in `kinds(name)` (a GGML type name) and its tokenizer;
    `extra(writer)` adds metadata."""
    import gguf

    cfg = json.loads((ckpt / "config.json").read_text())
    arch = GGUF_ARCH[family]
    w = gguf.GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    w.add_name(f"tiny-{family}")
    L = cfg["num_hidden_layers"]
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if family == "deepseek_v2":
        _mla_metadata(w, cfg)
    elif family == "mixtral":
        w.add_expert_count(cfg["num_local_experts"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    else:
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    _tokenizer(w, ckpt)
    if extra is not None:
        extra(w)
    for name, t in tensors_of(family, ckpt, split_kv_b).items():
        kind = kinds(name) if callable(kinds) else kinds
        if kind == "F32" or t.ndim == 1:
            w.add_tensor(name, t.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(name, t.astype(np.float16))
        else:
            w.add_tensor(name, quantize(t, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _mla_metadata(w, cfg: dict) -> None:
    """What llama.cpp's converter writes for DeepSeek-V2 (plain RoPE only: the test checkpoints choose it)."""
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_uint32("deepseek2.expert_group_count", cfg["n_group"])
    w.add_uint32("deepseek2.expert_group_used_count", cfg["topk_group"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(cfg["kv_lora_rank"])
    w.add_key_length(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_value_length(cfg["v_head_dim"])
    w.add_rope_dimension_count(cfg["qk_rope_head_dim"])


def _tokenizer(w, ckpt: Path) -> None:
    tj = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    special = {t["id"]: t["content"] for t in tj.get("added_tokens", [])}
    tokens = [None] * (max(max(vocab.values()), max(special, default=0)) + 1)
    for tok, i in vocab.items():
        tokens[i] = tok
    for i, tok in special.items():
        tokens[i] = tok
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    template = ckpt / "chat_template.jinja"  # where transformers saves it
    if template.is_file():
        w.add_chat_template(template.read_text())


def reference_model(family: str, gguf_path: Path, ckpt: Path, dtype=torch.float64):
    """transformers' model of the checkpoint carrying the GGUF's weights as the gguf package dequantizes them
    (for families transformers cannot read from GGUF itself, such as Mixtral)."""
    import gguf

    from core.model.gguf.arch import unpermute

    m = hf_model(ckpt)
    r = gguf.GGUFReader(gguf_path)
    deq = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
           .float().reshape(tuple(reversed(t.shape.tolist()))) for t in r.tensors}
    cfg = m.config
    sd = m.state_dict()
    new = {h: deq[g] for h, g in name_map(cfg.num_hidden_layers).items() if h in sd}
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        if family == "mixtral":
            for proj, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads)):
                new[p + f"self_attn.{proj}_proj.weight"] = unpermute(deq[b + f"attn_{proj}.weight"], heads)
        if p + "mlp.experts.gate_up_proj" not in sd:
            continue
        new[p + "mlp.experts.gate_up_proj"] = torch.cat([deq[b + "ffn_gate_exps.weight"], deq[b + "ffn_up_exps.weight"]], 1)
        new[p + "mlp.experts.down_proj"] = deq[b + "ffn_down_exps.weight"]
    assert set(new) == set(sd), set(sd) ^ set(new)
    m.load_state_dict(new)
    return m.to(dtype)


# ---- the reference reading: greedy tokens within near-ties, logit error -----------------------------------
# A first differing token is forgiven only where transformers' top-2 logits at that step differ by less than
# this: the float32 reference reading and transformers' float32 model agree to ~1e-5 here, so a gap below 1e-3
# is a tie that summation order alone may break.
NEAR_TIE = 1e-3
FORMATS = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")


def uniform(kind: str):
    """Every matrix in `kind` (MXFP4: the experts, llama.cpp's gpt-oss mix; Q8_0 elsewhere), F32 norms and router."""
    def kinds(name: str) -> str:
        if name.endswith("norm.weight") or "ffn_gate_inp" in name:
            return "F32"
        return "Q8_0" if kind == "MXFP4" and "exps" not in name else kind
    return kinds


def greedy_mismatches(engine, ref, prompts: list[str], new: int = 8) -> list[str]:
    """The prompts whose greedy tokens from `engine` part from `ref`'s (a transformers model), beyond near-ties."""
    from core.runtime.engine import Request

    reqs = [Request(id=str(i), prompt=p, max_new_tokens=new) for i, p in enumerate(prompts)]
    got = {r.id: r.output_token_ids for r in engine.generate(reqs)}
    bad = []
    for r in reqs:
        ids = engine.prompt_token_ids(r)
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0)
        want = _until_eos(out.sequences[0, len(ids):].tolist(), engine.eos_ids)
        mine = _until_eos(got[r.id], engine.eos_ids)
        step = next((j for j, (a, b) in enumerate(zip(mine, want)) if a != b), None)
        if step is None and len(mine) != len(want):
            step = min(len(mine), len(want))
        if step is None:
            continue
        top2 = out.logits[step][0].double().topk(2).values
        if (top2[0] - top2[1]).item() >= NEAR_TIE:  # else a near-tie: forgiven
            gap = (top2[0] - top2[1]).item()
            bad.append(f"prompt {r.id} parts at token {step}: {mine} vs {want} (top-2 gap {gap:.2e})")
    return bad


def _until_eos(tokens: list[int], eos) -> list[int]:
    return next((tokens[:j] for j, t in enumerate(tokens) if t in eos), tokens)


def first_logits(engine, prompts: list[str]) -> torch.Tensor:
    """The engine's prefill logits for each prompt's last token, float64 [P, V]."""
    from core.runtime.engine import Request

    ids = [engine.prompt_token_ids(Request(id=str(i), prompt=p)) for i, p in enumerate(prompts)]
    runner = engine.runner(slots=len(ids), micro_batch_size=len(ids), max_tokens=128)
    logits, _ = runner.prefill(ids, list(range(len(ids))), [list(range(len(ids)))])
    return logits.double()


def decode_logits(engine, prompts: list[str], steps: int = 3, token: int = 7) -> torch.Tensor:
    """Logits of `steps` decode steps after the prompts' prefill, every request fed `token` (the same inputs
    for every reading: logits compared, not trajectories), float64 [steps · P, V]. Decode is where mlight's
    C kernels run (attention, dense panels, the experts)."""
    from core.runtime.engine import Request

    ids = [engine.prompt_token_ids(Request(id=str(i), prompt=p)) for i, p in enumerate(prompts)]
    n = len(ids)
    runner = engine.runner(slots=n, micro_batch_size=n, max_tokens=128)
    runner.prefill(ids, list(range(n)), [list(range(n))])
    pos, out = [len(x) for x in ids], []
    for _ in range(steps):
        logits, _ = runner.decode([[token] * n], [list(range(n))], [pos])
        out.append(logits.double().clone())
        pos = [p + 1 for p in pos]
    return torch.cat(out)


def logit_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max abs error, the worst prompt's max abs error over its logits' spread max − min)."""
    err = (got - want).abs().amax(-1)
    spread = want.amax(-1) - want.amin(-1)
    return err.max().item(), (err / spread).max().item()
