"""A GGUF model into per-layer flat buffers, its tokenizer and its ModelSpec. Dense tensors are expanded one at a
time; block-format experts are copied byte for byte (Q4_K_M's stay Q4_K/Q6_K in RAM, pages and on the device). Gate
and up of one type share `w13`, of two types stay `w1` and `w3`; layers may differ in types, so each has its layout.
"""

from __future__ import annotations

from pathlib import Path

import torch

from core.errors import ModelError, UnsupportedModelError
from core.model.families import spec_from_config
from core.model.gguf import arch
from core.model.gguf.files import GGUFModel, find_gguf, read_float, read_into
from core.model.quant.dense_spec import DENSE_NAMES
from core.model.quant.experts import ExpertScheme, Matrix
from core.model.quant.formats import GGUF_BLOCKS, Format
from core.model.spec import ModelSpec
from core.telemetry import EventSink, Progress, ignore

FLOAT_KINDS = ("F32", "F16", "BF16")
BLOCK_DENSE = (*DENSE_NAMES, "lm_head")  # projections a quantized GGUF keeps as its blocks in the CPU-only mode
# architectures whose GGUF config transformers cannot read: their tokenizer is built without it
TOKENIZER_ONLY = ("deepseek2",)


def open_gguf(path: str | Path) -> GGUFModel:
    paths = find_gguf(path)
    if paths is None:
        raise ModelError(f"{path} is not a GGUF file", "give a .gguf file or a folder holding one")
    return GGUFModel(paths)


def expert_scheme(g: GGUFModel, spec: ModelSpec, i: int) -> ExpertScheme | None:
    """Layer i's experts as stored (None: floats); a dense layer takes the first MoE layer's, one layout kind."""
    if not spec.is_moe(i):
        i = next((j for j in range(spec.num_layers) if spec.is_moe(j)), i)
    k = {}  # gate / up / down -> the GGML type of their tensor(s)
    for w, names in arch.expert_sources(i, set(g.tensors), spec.num_experts).items():
        missing = [n for n in names if n not in g.tensors]
        if missing:
            raise ModelError(f"{g.paths[0].name} has no tensor {missing[0]}", "the GGUF file is incomplete or damaged")
        kinds = {g.tensors[n].kind for n in names}
        if len(kinds) > 1:
            raise UnsupportedModelError(f"layer {i}'s {w} experts mix types {sorted(kinds)}",
                                        "use a GGUF whose experts of one projection share a type")
        k[w] = kind = kinds.pop()
        if kind not in GGUF_BLOCKS and kind not in FLOAT_KINDS:
            raise UnsupportedModelError(
                f"GGUF {g.arch} file {g.paths[0].name}: the {w} projections of the experts are {kind}, a quantization "
                "mlight does not run", f"use a GGUF whose experts are one of {', '.join(GGUF_BLOCKS)} (e.g. Q4_K_M, "
                "Q5_K_M, Q6_K, Q8_0) or F16/BF16")
    if all(kind in FLOAT_KINDS for kind in k.values()):
        return None
    if any(kind in FLOAT_KINDS for kind in k.values()):
        raise UnsupportedModelError(f"layer {i} mixes float and quantized experts ({k})",
                                    "use a GGUF whose experts are all quantized or all float")
    D, I = spec.hidden_size, spec.expert_intermediate
    fg, fu, fd = Format(k["gate"]), Format(k["up"]), Format(k["down"])
    for f, kk in ((fg, D), (fu, D), (fd, I)):
        f.check(0, kk, "a GGUF expert tensor")
    up = (Matrix("w13", fg, 2 * I, D),) if fg == fu else (Matrix("w1", fg, I, D), Matrix("w3", fu, I, D))
    return ExpertScheme(up, Matrix("w2", fd, D, I))


def load_spec(g: GGUFModel) -> ModelSpec:
    """Our ModelSpec for the file, its expert format and bits per weight from the tensors' own types."""
    import dataclasses

    spec = spec_from_config(arch.config(g), source=f"{g.paths[0].name} (GGUF metadata)")
    schemes = [expert_scheme(g, spec, i) for i in range(spec.num_layers)]
    if schemes[0] is None:
        return spec
    if any(s is None for s in schemes):
        raise UnsupportedModelError("some layers of the GGUF have float experts and others quantized ones",
                                    "use a GGUF quantized the same way throughout")
    label = "/".join(sorted({m.fmt.name for s in schemes for m in s.matrices}))
    bits = sum(s.bits_per_weight() for s in schemes) / len(schemes)
    return dataclasses.replace(spec, expert_format=label, expert_bits=bits)


def load_tokenizer(g: GGUFModel):
    """transformers' tokenizer rebuilt from the GGUF metadata (vocabulary, merges, special ids, chat template)."""
    from transformers import AutoTokenizer

    first = g.paths[0]
    if not g.meta("tokenizer.ggml.model"):
        raise ModelError(f"{first.name} carries no tokenizer", "use a GGUF file that includes its tokenizer")
    try:
        if g.arch in TOKENIZER_ONLY:
            from transformers import PreTrainedTokenizerFast as AutoTokenizer  # noqa: N814
        tok = AutoTokenizer.from_pretrained(str(first.parent), gguf_file=first.name, local_files_only=True)
    except Exception as e:  # transformers raises many types here; all mean the same to the user
        raise ModelError(f"cannot build the tokenizer from {first.name}: {str(e).splitlines()[0]}",
                         "the GGUF's tokenizer metadata is not one transformers can read") from e
    template = g.meta("tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    return tok


def fill_dense(g: GGUFModel, places: list[arch.Place], dest: dict[str, torch.Tensor], blocks: bool) -> dict:
    """The dense tensors `places` name into `dest`, expanded to its dtype; with `blocks`, the projections the
    CPU's block kernel takes stay the file's blocks, left unwritten in `dest`: returned as BlockWeights."""
    from core.model.quant.block_dense import BlockWeight

    covered: dict[str, int] = {}
    held: dict[str, list] = {}
    for p in places:
        if blocks and p.dest in BLOCK_DENSE:
            seg = _block_rows(g, p, dest[p.dest])
            if seg is not None:
                held.setdefault(p.dest, []).append(seg)
                covered[p.dest] = covered.get(p.dest, 0) + (seg.r1 - seg.r0) * dest[p.dest].shape[-1]
                continue
        w = _read_float(g, p.src)
        if p.unpermute:
            w = arch.unpermute(w, p.unpermute)
        if p.unsqueeze:
            w = w.reshape(1, -1)
        target = dest[p.dest] if p.rows is None else dest[p.dest][p.rows[0]:p.rows[1]]
        _check_shape(p.src, w.shape, target.shape)
        target.copy_(w)
        covered[p.dest] = covered.get(p.dest, 0) + target.numel()
    for name, t in dest.items():
        if covered.get(name, 0) != t.numel():
            raise ModelError(f"the GGUF file does not provide all of {name}", "the file is incomplete or damaged")
    return {name: BlockWeight(tuple(dest[name].shape), dest[name].dtype, segs) for name, segs in held.items()}


def _block_rows(g: GGUFModel, p: arch.Place, target: torch.Tensor):
    from core.model.cpu import gguf_blocks
    from core.model.quant.block_dense import Segment

    ref = g.tensors.get(p.src)
    if (ref is None or len(ref.shape) != 2 or ref.kind not in GGUF_BLOCKS
            or not gguf_blocks.runs(ref.kind, target.dtype, ref.shape[1])):
        return None
    r0, r1 = p.rows or (0, target.shape[0])
    _check_shape(p.src, ref.shape, (r1 - r0, target.shape[-1]))
    raw = torch.empty(ref.nbytes, dtype=torch.uint8)
    read_into(ref, raw)
    rows = raw.view(ref.shape[0], -1)
    if p.unpermute:  # a permutation of whole rows: each row's blocks stay as they are
        rows = arch.unpermute(rows, p.unpermute).contiguous()
    return Segment(r0, r1, ref.kind, rows)


def fill_experts(g: GGUFModel, spec: ModelSpec, i: int, scheme: ExpertScheme | None, tensors: dict) -> None:
    if not spec.is_moe(i):
        return
    src = arch.expert_sources(i, set(g.tensors), spec.num_experts)
    I = spec.expert_intermediate
    if scheme is None:
        for w, names in src.items():
            dest = tensors["w2"] if w == "down" else tensors["w13"][:, :I] if w == "gate" else tensors["w13"][:, I:]
            for e, name in enumerate(names):  # one stacked tensor, or one per expert
                x = read_float(g.tensors[name])
                target = dest if len(names) == 1 else dest[e]
                _check_shape(name, x.shape, target.shape)
                target.copy_(x)
        return
    for w, names in src.items():
        matrix = "w2" if w == "down" else ("w13" if scheme.up[0].name == "w13" else {"gate": "w1", "up": "w3"}[w])
        raw = tensors[f"{matrix}.raw"]  # [E, rows, bytes per row]
        lo = I if (matrix == "w13" and w == "up") else 0
        rows = raw.shape[1] if matrix != "w13" else I
        per_expert = rows * raw.shape[2]
        for e in range(spec.num_experts):
            ref = g.tensors[names[0] if len(names) == 1 else names[e]]
            want = per_expert * (spec.num_experts if len(names) == 1 else 1)
            if ref.nbytes != want:
                raise ModelError(f"GGUF tensor {ref.name} has {ref.nbytes} bytes, expected {want}",
                                 "the GGUF metadata does not match its tensors")
            read_into(ref, raw[e, lo:lo + rows], start=e * per_expert if len(names) == 1 else 0)


def _check_shape(name: str, got, want) -> None:
    if tuple(got) != tuple(want):
        raise ModelError(f"GGUF tensor {name} has shape {tuple(got)}, expected {tuple(want)}",
                         "the GGUF metadata does not match its tensors")


def _read_float(g: GGUFModel, name: str) -> torch.Tensor:
    k_b, v_b = name.replace("attn_kv_b", "attn_k_b"), name.replace("attn_kv_b", "attn_v_b")
    if name in g.tensors:
        return read_float(g.tensors[name])
    if k_b in g.tensors and v_b in g.tensors:  # DeepSeek's kv_b, split by the converter: k_b [H, R, dn], v_b [H, dv, R]
        k_b, v_b = read_float(g.tensors[k_b]), read_float(g.tensors[v_b])
        return torch.cat([k_b.transpose(1, 2), v_b], 1).reshape(-1, k_b.shape[1])  # [H·(dn+dv), R]
    raise ModelError(f"{g.paths[0].name} has no tensor {name}", "the GGUF file is incomplete or damaged")


def load_gguf_weights(g: GGUFModel, spec: ModelSpec, *, dtype: torch.dtype | None = None, pages_per_layer: int = 1,
                      progress: EventSink = ignore, cpu_only: bool = False):
    """`cpu_only`: the quantized projections stay the file's blocks for pack_for_cpu; else all expanded."""
    from core.model.weights import LayerLayout, LayerWeights, ModelWeights

    dtype = dtype or spec.torch_dtype
    total = spec.num_layers + 1
    blocks = cpu_only and spec.expert_format != "none"  # quantized experts: LayerWeights.pack_for_cpu packs them
    globals_ = {name: torch.empty(shape, dtype=dtype) for name, shape in spec.global_shapes().items()}
    global_blocks = fill_dense(g, arch.global_places(spec), globals_, blocks)
    what = f"loading {g.name} ({spec.expert_format if spec.expert_format != 'none' else 'float'} experts)"
    progress(Progress(what, 1, total, "layers"))
    layers, scratch = [], {}
    names = set(g.tensors)
    for i in range(spec.num_layers):
        scheme = expert_scheme(g, spec, i)
        layout = LayerLayout.for_spec(spec, i, scheme, dtype)
        lw = LayerWeights(layout, layout.buffer(dtype), pages_per_layer, dtype, scratch)
        lw.block_dense = fill_dense(g, arch.dense_places(spec, i, names), lw.dense(), blocks)
        fill_experts(g, spec, i, scheme, lw.tensors)
        layers.append(lw)
        progress(Progress(what, i + 2, total, "layers"))
    weights = ModelWeights(spec, layers, globals_, dtype)
    weights.block_dense = global_blocks
    return weights
