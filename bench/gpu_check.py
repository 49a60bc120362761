"""The one-shot GPU check: correctness on CUDA, then CGOPipe vs S3 vs S4 vs HF accelerate offload.

Prepared to run once on a single-GPU machine in under 8 minutes with nothing to fetch:
  (a) tiny random checkpoints of every family: tokens of the CUDA pipeline (every schedule) equal the
      CPU engine's tokens;
  (b) a Mixtral-shaped bf16 model larger than a GPU memory cap set with
      `torch.cuda.set_per_process_memory_fraction` (16 GB = a T4, 24 GB = an L4): tokens/s of the
      CGOPipe, S3 and S4 schedules under the planner's policy for that cap, HF accelerate offload
      (`device_map="auto"` + `max_memory`) on the same model and cap, the planner's prediction, the
      measured PCIe bandwidth, and per-resource utilisation;
  (c) a table printed last; every figure written to $OUT/gpu_check.json (or --out).

`--dry-run` runs the same code on the CPU with tiny sizes (threaded executor instead of CUDA streams,
no memory cap, transformers on the CPU as the baseline) so CI proves the script end to end.

    python bench/gpu_check.py --dry-run
    python bench/gpu_check.py                       # on the GPU machine
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests", ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

from core.runtime.engine import Engine, Request  # noqa: E402
from core.telemetry import RESOURCES, StepDone  # noqa: E402

BIG = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, experts=8, top_k=2, vocab=32000)
TINY = dict(hidden=256, intermediate=512, heads=8, kv_heads=2, experts=8, top_k=2, vocab=512)
GIB = 1 << 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, same code paths except CUDA")
    p.add_argument("--out", type=Path, default=None, help="where to write gpu_check.json (default $OUT or .)")
    p.add_argument("--layers", type=int, default=None, help="layers of the big model (default 10: 29 GB)")
    p.add_argument("--caps", default="16,24", help="GPU memory caps in GB (default 16,24: a T4 and an L4)")
    p.add_argument("--requests", type=int, default=None, help="requests per run (default 256; 8 dry)")
    p.add_argument("--gen-len", type=int, default=None, help="tokens per request (default 32; 4 dry)")
    p.add_argument("--hf-requests", type=int, default=8, help="requests for the accelerate baseline")
    p.add_argument("--hf-gen-len", type=int, default=None, help="tokens per request for the baseline (8; 4 dry)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--multi-gpu", action="store_true",
                   help="also (d): tensor-parallel scaling over this machine's GPUs (bench/multi_gpu.py)")
    a = p.parse_args(argv)
    a.layers = a.layers or (4 if a.dry_run else 10)
    a.requests = a.requests or (8 if a.dry_run else 256)
    a.gen_len = a.gen_len or (4 if a.dry_run else 32)
    a.hf_gen_len = a.hf_gen_len or (4 if a.dry_run else 8)
    a.caps = [float(c) for c in a.caps.split(",")]
    a.out = a.out or Path(os.environ.get("OUT", "."))
    return a


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- (a) correctness ------------------------------------------------------------------------------
def family_parity(args, work: Path) -> list[dict]:
    from checkpoints import FAMILIES, make_checkpoint

    executor = "threaded" if args.dry_run else "cuda"
    rows = []
    prompts = ["Hi", "Compose an engaging travel blog post about Hawaii.", "x y z", "What is 2+2? Explain.",
               "Draft an email to a colleague.", "Tell me a story about a cat and a dog"]
    for fam in FAMILIES:
        path = make_checkpoint(fam, work / f"tiny-{fam}", num_hidden_layers=3) if fam != "dbrx" else \
            make_checkpoint(fam, work / f"tiny-{fam}", n_layers=3)
        reqs = [Request(id=str(i), prompt=p, max_new_tokens=6) for i, p in enumerate(prompts)]
        ref = Engine.load(path)
        ref.eos_ids = set()
        want = {r.id: r.output_token_ids for r in ref.generate(reqs, batch_size=4, micro_batch_size=2)}
        for schedule in ("cgopipe", "s3", "s4"):
            eng = Engine.load(path, executor=executor, schedule=schedule, pages_per_layer=2, resident_layers=1)
            eng.eos_ids = set()
            try:
                got = {r.id: r.output_token_ids for r in eng.generate(reqs, batch_size=4, micro_batch_size=2)}
            finally:
                eng.close()
            rows.append({"family": fam, "schedule": schedule, "executor": executor, "equal": got == want})
            log(f"parity {fam:9} {schedule:7} {executor}: {'OK' if got == want else 'MISMATCH'}")
    return rows


# ---- (b) speed under a memory cap -----------------------------------------------------------------
def build_big(path: Path, layers: int, dims: dict, seed: int = 0) -> Path:
    """A Mixtral-shaped bf16 checkpoint written shard by shard (per-expert layout, as on the hub).

    Values are slices of one random bank at random offsets: realistic magnitudes, built in seconds."""
    from safetensors.torch import save_file
    from transformers import MixtralConfig

    from core.model.demo import build_tokenizer

    if (path / "model.safetensors.index.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    D, I, H, Hkv, E, V = (dims[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "experts", "vocab"))
    hd = D // H
    build_tokenizer(path, vocab_size=min(V, 4096))
    cfg = MixtralConfig(vocab_size=V, hidden_size=D, intermediate_size=I, num_hidden_layers=layers,
                        num_attention_heads=H, num_key_value_heads=Hkv, num_local_experts=E,
                        num_experts_per_tok=dims["top_k"], max_position_embeddings=4096, bos_token_id=1,
                        eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    cfg.dtype = "bfloat16"
    cfg.architectures = ["MixtralForCausalLM"]
    cfg.save_pretrained(str(path))
    g = torch.Generator().manual_seed(seed)
    bank = (torch.randn(1 << 26, generator=g) * 0.02).to(torch.bfloat16)

    def rand(*shape):
        n = 1
        for s in shape:
            n *= s
        out = torch.empty(n, dtype=torch.bfloat16)
        done = 0
        while done < n:  # tile random slices of the bank
            take = min(n - done, bank.numel() // 2)
            off = int(torch.randint(0, bank.numel() - take + 1, (1,), generator=g))
            out[done:done + take] = bank[off:off + take]
            done += take
        return out.view(*shape)

    weight_map = {}

    def shard(name: str, tensors: dict):
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    shard("model-globals.safetensors", {"model.embed_tokens.weight": rand(V, D), "lm_head.weight": rand(V, D),
                                        "model.norm.weight": torch.ones(D, dtype=torch.bfloat16)})
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": torch.ones(D, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(D, dtype=torch.bfloat16),
             p + "self_attn.q_proj.weight": rand(H * hd, D), p + "self_attn.k_proj.weight": rand(Hkv * hd, D),
             p + "self_attn.v_proj.weight": rand(Hkv * hd, D), p + "self_attn.o_proj.weight": rand(D, H * hd),
             p + "block_sparse_moe.gate.weight": rand(E, D) * 10}
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            t.update({q + "w1.weight": rand(I, D), q + "w3.weight": rand(I, D), q + "w2.weight": rand(D, I)})
        shard(f"model-layer-{i:03d}.safetensors", t)
        log(f"built layer {i + 1}/{layers}")
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def pcie_bandwidth(dry: bool) -> dict:
    if dry:
        return {"h2d_gbps": None, "d2h_gbps": None}
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for name, (dst, src) in {"h2d_gbps": (dev, host), "d2h_gbps": (host, dev)}.items():
        best = 0.0
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            best = max(best, n / (a.elapsed_time(b) / 1e3) / 1e9)
        out[name] = best
    del host, dev
    return out


def cap_gpu(gb: float | None) -> None:
    if gb is not None and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gb * 1e9 / total))


def plan_for_cap(engine: Engine, cap_gb: float, args, pcie: dict):
    """The planner's policy and prediction for this model on this machine with the GPU capped."""
    from core.plan.hardware import resolve
    from core.plan.planner import Budget, Workload, plan

    hw = resolve("local")
    if pcie.get("h2d_gbps"):
        hw = dataclasses.replace(hw, h2d_bw=pcie["h2d_gbps"] * 1e9, d2h_bw=pcie["d2h_gbps"] * 1e9)
    if args.dry_run and not hw.has_gpu:  # the CPU plays the GPU: its own rates on both sides of a "link"
        hw = dataclasses.replace(hw, gpu_name="CPU (dry run)", gpu_count=1, gpu_mem_bytes=int(cap_gb * 1e9),
                                 gpu_flops=hw.cpu_flops, gpu_bw=hw.cpu_bw, h2d_bw=hw.cpu_bw, d2h_bw=hw.cpu_bw)
    hw = dataclasses.replace(hw, gpu_mem_bytes=int(cap_gb * 1e9), gpu_mem_free_bytes=None,
                             gpu_count=min(1, hw.gpu_count))  # the check runs one GPU
    work = Workload(prompt_len=77, gen_len=args.gen_len, max_prompt_len=418, num_requests=args.requests)
    budget = Budget(gpu_bytes=int(cap_gb * 1e9), cpu_bytes=int(0.8 * hw.cpu_mem_bytes))
    policy, pred = plan(engine.spec, hw, work, budget, ranks=1)  # one process on one GPU
    return policy, pred, hw, work


def run_schedule(engine: Engine, policy, schedule: str, reqs, dry: bool) -> dict:
    L = engine.spec.num_layers
    engine.configure(schedule=schedule, attention_on="gpu" if schedule == "s4" else "cpu",
                     resident_layers=int(policy.gpu_weight_fraction * L + 1e-9),
                     expert_group=policy.micro_batches_per_expert_batch, pages_per_layer=policy.pages_per_layer)
    events: list[StepDone] = []
    t0 = time.perf_counter()
    results = list(engine.generate(reqs, batch_size=policy.batch_size, micro_batch_size=policy.micro_batch_size,
                                   on_event=lambda e: events.append(e) if isinstance(e, StepDone) else None))
    wall = time.perf_counter() - t0
    decode = [e for e in events if e.kind == "decode"]
    dsec = sum(e.seconds for e in decode) or 1e-9
    tokens = sum(r.output_tokens for r in results)
    return {"schedule": schedule, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "decode_tokens_per_s": sum(e.tokens for e in decode) / dsec,
            "utilization": {r: sum(e.busy.get(r, 0.0) for e in decode) / dsec for r in RESOURCES},
            "h2d_gb_per_step": sum(e.bytes_h2d for e in decode) / max(1, len(decode)) / 1e9,
            "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if not dry else 0.0}


def hf_offload(path: Path, cap_gb: float, reqs, gen_len: int, dry: bool) -> dict:
    """transformers + accelerate offload: device_map="auto" with max_memory at the cap."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    kw = dict(device_map={"": "cpu"}) if dry else dict(
        device_map="auto", max_memory={0: f"{max(1.0, cap_gb - 2):.0f}GiB", "cpu": "400GiB"})
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, **kw).eval()
    load = time.perf_counter() - t0
    batch = tok([r.prompt for r in reqs], return_tensors="pt", padding=True)
    dev = "cpu" if dry else "cuda"
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**{k: v.to(dev) for k, v in batch.items()}, max_new_tokens=gen_len, min_new_tokens=gen_len,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    wall = time.perf_counter() - t0
    tokens = (out.shape[1] - batch["input_ids"].shape[1]) * len(reqs)
    del model
    gc.collect()
    if not dry:
        torch.cuda.empty_cache()
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "load_seconds": load}


def big_model(args, work: Path, pcie: dict) -> list[dict]:
    from core.io.workloads import build_prompts, target_lengths

    dims = TINY if args.dry_run else BIG
    path = build_big(work / "big", args.layers, dims)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
    log(f"model: {size:.1f} GB on disk, {args.layers} layers")
    engine = Engine.load(path, executor="threaded" if args.dry_run else "cuda", schedule="cgopipe", pages_per_layer=1,
                         resident_layers=0)
    engine.eos_ids = set()
    prompts = build_prompts(engine.tokenizer, target_lengths(args.requests, max_len=418))
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=args.gen_len) for i, p in enumerate(prompts)]
    rows = []
    try:
        for cap in args.caps:
            cap_gpu(None if args.dry_run else cap)
            policy, pred, hw, workload = plan_for_cap(engine, cap, args, pcie)
            log(f"cap {cap:g} GB: plan N={policy.batch_size} mu={policy.micro_batch_size} "
                f"resident={policy.gpu_weight_fraction:.2f} pages={policy.pages_per_layer}; "
                f"predicts {pred.tokens_per_s:.1f} tok/s")
            row = {"cap_gb": cap, "model_gb": size, "policy": policy.to_dict(), "prediction": pred.to_dict(),
                   "runs": []}
            for schedule in ("cgopipe", "s4", "s3"):
                if not args.dry_run:
                    torch.cuda.reset_peak_memory_stats()
                try:
                    r = run_schedule(engine, policy, schedule, reqs, args.dry_run)
                except Exception as e:  # a baseline that cannot run at this cap is a result, not a crash
                    r = {"schedule": schedule, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                row["runs"].append(r)
                log(f"  {schedule:7} {r.get('tokens_per_s', float('nan')):8.1f} tok/s  {r.get('error', '')}")
            if not args.skip_hf:
                try:
                    row["hf_offload"] = hf_offload(path, cap, reqs[:args.hf_requests], args.hf_gen_len, args.dry_run)
                except Exception as e:
                    row["hf_offload"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                log(f"  hf-offload {row['hf_offload'].get('tokens_per_s', float('nan')):8.2f} tok/s")
            rows.append(row)
    finally:
        engine.close()
    return rows


def table(report: dict) -> str:
    lines = ["", "GPU check — " + report["device"], ""]
    ok = all(r["equal"] for r in report["parity"])
    lines.append(f"(a) CUDA pipeline tokens == CPU engine tokens: {'all equal' if ok else 'MISMATCH'} "
                 f"({len(report['parity'])} family × schedule runs)")
    lines.append(f"    PCIe measured: H2D {report['pcie'].get('h2d_gbps') or 0:.1f} GB/s, "
                 f"D2H {report['pcie'].get('d2h_gbps') or 0:.1f} GB/s")
    lines.append("(b) cap   schedule    tok/s  predicted  pred.err  vs-HF   gpu  cpu_attn  h2d   d2h")
    for row in report["big"]:
        hf = row.get("hf_offload", {}).get("tokens_per_s")
        pred = row["prediction"]["tokens_per_s"]
        for r in row["runs"]:
            if "error" in r:
                lines.append(f"    {row['cap_gb']:4.0f}  {r['schedule']:8}  error: {r['error'][:60]}")
                continue
            u = r["utilization"]
            err = abs(pred - r["tokens_per_s"]) / r["tokens_per_s"]
            vs = f"{r['tokens_per_s'] / hf:6.1f}x" if hf else "   n/a"
            lines.append(f"    {row['cap_gb']:4.0f}  {r['schedule']:8} {r['tokens_per_s']:8.1f} {pred:10.1f} "
                         f"{err:8.0%} {vs}  {u['gpu']:4.0%} {u['cpu_attn']:8.0%} {u['h2d']:4.0%} {u['d2h']:5.0%}")
        if hf:
            lines.append(f"    {row['cap_gb']:4.0f}  hf-offload {hf:8.2f}")
    if "multi_gpu" in report:
        from multi_gpu import table_lines

        lines += table_lines(report["multi_gpu"])
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA GPU: run with --dry-run on the CPU", file=sys.stderr)
        return 2
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mlight-gpu-check-"))
    os.environ.setdefault("MLIGHT_CACHE_DIR", str(work / "cache"))
    device = "CPU dry run" if args.dry_run else torch.cuda.get_device_name(0)
    report = {"device": device, "torch": torch.__version__, "dry_run": args.dry_run, "args": {
        k: str(v) for k, v in vars(args).items()}}
    t0 = time.perf_counter()
    report["parity"] = family_parity(args, work)
    report["pcie"] = pcie_bandwidth(args.dry_run)
    report["big"] = big_model(args, work, report["pcie"])
    if args.multi_gpu:
        from multi_gpu import multi_gpu

        report["multi_gpu"] = multi_gpu(args, work, work / "big", log)
    report["seconds"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(table(report))
    print(f"\nfull figures: {args.out / 'gpu_check.json'} ({report['seconds']:.0f} s)")
    return 0 if all(r["equal"] for r in report["parity"]) else 1


if __name__ == "__main__":
    sys.exit(main())
