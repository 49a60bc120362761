"""Accuracy of quantized experts against bf16: next-token top-1 agreement, mean KL, per-layer relative error.

A ≥ 100M-parameter random bf16 Mixtral-shaped checkpoint (transformers' classes; a larger init range
than the default so that logits are peaked and a changed top-1 means something) reads MT-Bench text
(the 80 questions' first turns, concatenated, cut into sequences) teacher-forced through our engine:
bf16 experts (the reference), then int8 and int4 at group sizes 32, 64 and 128. Also the fp32 engine,
to show how far bf16 itself sits from full precision, and int8 / int4-g64 experts with the dense
weights (attention projections, LM head) quantized too (`--quantize-dense [int8|int4]`, CPU-only mode). Per position: top-1 agreement with the bf16
reference and KL(reference ‖ format) of the next-token distributions (float64). Per layer: the routed
experts' relative output error ‖y_q − y‖ / ‖y‖ on that layer's real inputs (captured from transformers'
bf16 model on the same text), routing held fixed.

Caveat: random weights are Gaussian; trained checkpoints have outlier channels that group-wise
scales handle differently. The figures say how much the formats perturb a model of this shape; a
trained checkpoint's table needs that checkpoint (the script takes --model DIR).

    python bench/quant_accuracy.py               # ≈ 160M parameters, 2,040 positions
    python bench/quant_accuracy.py --quick       # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import common  # noqa: E402

FULL = dict(hidden=768, intermediate=2048, layers=4, heads=12, kv_heads=4, experts=8, top_k=2, vocab=4096)
QUICK = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, experts=4, top_k=2, vocab=1024)
FORMATS = (("int8", None), ("int4", 32), ("int4", 64), ("int4", 128))
DENSE = (("int8", None, True), ("int4", 64, "int8"), ("int4", 64, True))  # --quantize-dense [FORMAT]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model", type=Path, default=None, help="a bf16 checkpoint to measure instead of the random one")
    p.add_argument("--seqs", type=int, default=None, help="sequences (default 8; 2 quick)")
    p.add_argument("--len", type=int, default=None, help="tokens per sequence (default 256; 32 quick)")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--only-dense", action="store_true", help="only the reference and the --quantize-dense rows")
    return p.parse_args(argv)


def text_sequences(tokenizer, n: int, length: int) -> list[list[int]]:
    from core.io.workloads import first_turns

    ids = tokenizer("\n\n".join(first_turns())).input_ids
    if len(ids) < n * length:
        ids = ids * (n * length // len(ids) + 1)
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def teacher_forced_logits(engine, seqs: list[list[int]]) -> torch.Tensor:
    """[positions, V] float32: logits after each prefix, feeding the true next token (positions 1..len−1)."""
    n, length = len(seqs), len(seqs[0])
    runner = engine.runner(slots=n, micro_batch_size=n, max_tokens=length + 1)
    first, _ = runner.prefill([s[:1] for s in seqs], list(range(n)), [list(range(n))])
    out = [first]
    for t in range(1, length - 1):
        logits, _ = runner.decode([[s[t] for s in seqs]], [list(range(n))], [[t] * n])
        out.append(logits.clone())  # the runner reuses its logits buffer the next step
    return torch.stack(out, 1).reshape(-1, first.shape[-1]).float()


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"top1_agreement": (ref.argmax(-1) == got.argmax(-1)).double().mean().item(),
            "mean_kl": kl.mean().item(), "p99_kl": kl.quantile(0.99).item(), "positions": ref.shape[0]}


def layer_errors(model_dir: Path, seqs, formats) -> dict:
    """Per layer and format: relative error of the routed experts' output on the layer's real inputs."""
    from transformers import AutoModelForCausalLM

    from core.model.moe import experts, route
    from core.model.quant.experts import ExpertScheme, QuantExperts
    from core.model.quant.formats import Format, fit_group, quantize

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    inputs = {}
    hooks = [layer.mlp.register_forward_hook(lambda m, a, o, i=i: inputs.setdefault(i, []).append(a[0].reshape(-1, a[0].shape[-1])))
             for i, layer in enumerate(hf.model.layers)]
    with torch.no_grad():
        for s in seqs[:2]:
            hf(torch.tensor([s]))
    for h in hooks:
        h.remove()
    from core.model.families import load_spec

    spec = load_spec(model_dir)
    out = {}
    for i, layer in enumerate(hf.model.layers):
        h = torch.cat(inputs[i])
        w13, w2 = layer.mlp.experts.gate_up_proj.data, layer.mlp.experts.down_proj.data
        rw, ridx = route(spec, h, {"router": layer.mlp.gate.weight.data})
        want = experts(h.float(), w13.float(), w2.float(), rw.float(), ridx, grouped=False).double()
        row = {}
        for name, group in formats:
            fmt = fit_group(Format(name, group or 0) if name == "int4" else Format(name), spec.hidden_size,
                            spec.expert_intermediate)
            parts = {f"w13.{k}": v for k, v in quantize(fmt, w13).items()} | {f"w2.{k}": v for k, v in quantize(fmt, w2).items()}
            q = QuantExperts(ExpertScheme.uniform(fmt, spec.hidden_size, spec.expert_intermediate), parts, torch.float32)
            got = experts(h.float(), None, None, rw.float(), ridx, quant=q).double()
            row[fmt.label] = ((got - want).norm() / want.norm()).item()
        bf = experts(h, w13, w2, rw, ridx, grouped=False).double()  # bf16 compute itself, for scale
        row["bfloat16 compute"] = ((bf - want).norm() / want.norm()).item()
        out[i] = row
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    dims = QUICK if args.quick else FULL
    nseq, length = args.seqs or (2 if args.quick else 8), args.len or (32 if args.quick else 256)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mlight-quant-acc-"))
    os.environ.setdefault("MLIGHT_CACHE_DIR", str(work / "cache"))
    model_dir = args.model or work / "model"
    if args.model is None and not (model_dir / "config.json").is_file():
        info = common.build_mixtral(model_dir, **dims, initializer_range=0.05)
        print(f"built a {info['params'] / 1e6:.0f}M-parameter random bf16 Mixtral-shaped checkpoint", flush=True)
    from core.runtime.engine import Engine

    ref_engine = Engine.load(model_dir, dtype="bfloat16")
    seqs = text_sequences(ref_engine.tokenizer, nseq, length)
    ref = teacher_forced_logits(ref_engine, seqs)
    params = ref_engine.spec.num_params
    ref_engine.close()
    del ref_engine
    rows = {}
    if not args.only_dense:
        fp32 = Engine.load(model_dir, dtype="float32")
        rows["float32 (no quantization)"] = compare(ref, teacher_forced_logits(fp32, seqs))
        fp32.close()
        del fp32
    runs = list(DENSE) if args.only_dense else [(n, g, False) for n, g in FORMATS] + list(DENSE)
    for name, group, dense in runs:
        e = Engine.load(model_dir, dtype="bfloat16", quantize=name, group_size=group, quantize_dense=dense, device="cpu")
        label = e.weights.scheme.label + ("" if not dense else " + dense " + (name if dense is True else dense))
        rows[label] = compare(ref, teacher_forced_logits(e, seqs))
        rows[label]["bits_per_weight"] = e.spec.expert_bits
        e.close()
        print(f"{label}: {rows[label]}", flush=True)
    layers = layer_errors(model_dir, seqs, () if args.only_dense else FORMATS)
    print(f"\nmodel: {params / 1e6:.0f}M parameters {dims if args.model is None else model_dir}; "
          f"{ref.shape[0]} positions of MT-Bench text; reference: the bf16 engine")
    print(f"{'format':>26} {'bits/w':>7} {'top-1 agree':>12} {'mean KL':>10} {'p99 KL':>10}")
    for k, r in rows.items():
        print(f"{k:>26} {r.get('bits_per_weight', 16):>7.2f} {r['top1_agreement']:>12.4f} {r['mean_kl']:>10.2e} {r['p99_kl']:>10.2e}")
    print("\nper-layer relative error of the routed experts' output (vs float32 over bf16 weights):")
    names = list(next(iter(layers.values())))
    print("layer " + " ".join(f"{n:>17}" for n in names))
    for i, row in layers.items():
        print(f"{i:>5} " + " ".join(f"{row[n]:>17.2e}" for n in names))
    if args.json:
        args.json.write_text(json.dumps({"model": dims, "params": params, "positions": ref.shape[0], "formats": rows,
                                         "layers": layers}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
