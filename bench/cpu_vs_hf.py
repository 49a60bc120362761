"""CPU mode vs transformers `generate`: tokens/s on the same workload, and our fraction of the roofline.

Builds a ≈ 800M-parameter random bf16 Mixtral-shaped checkpoint (transformers' own classes +
`save_pretrained`, tokenizer from `core.model.demo.build_tokenizer`), a workload of 256 requests whose
prompts are MT-Bench first turns concatenated to an MT-Bench-like length spread (mean ≈ 77, max
418 tokens) with max_new_tokens in {32, 64, 96, 128}, then in one process:

1. measures the machine: bf16 GEMM FLOP/s and memory read bandwidth;
2. runs our engine (`Engine.generate`, Algorithm-2 micro-batches with refill);
3. tunes transformers on a probe (experts_implementation × batch size, sdpa attention, use_cache),
   then runs its fastest setting on the full workload: left-padded batches of requests that share a
   max_new_tokens value, sorted by prompt length (the least padding it can get);
4. prints tokens/s (generated tokens / wall time, prefill included) for both, the ratio, and our
   decode fraction of the roofline: per decode step, time ≥ max(FLOPs / peak, bytes / bandwidth)
   with bytes = weights touched (non-expert + expected distinct experts for the step's routed
   tokens, lm_head) + KV read; fraction = Σ lower bounds / Σ measured step times.

EOS and PAD rows of the lm_head are zeroed, so greedy decoding never stops early: both systems
generate exactly the requested tokens, and tokens are counted from the outputs (never assumed).

5. measures batch-1 decode (one request, `--single-tokens` new tokens) for both: decode tokens/s
   and the bound from reading the active weights at the measured bandwidth.

transformers runs in its best dtype for the machine (`--hf-dtype auto`: bf16 where the CPU has native
bf16 matmuls, fp32 on an AVX2 CPU, where torch's bf16 matmul is 10-100x slower). Threads default to the
cores other work leaves free (both systems get the same count); `--clock cpu` times by this process's
CPU seconds instead of the wall (with one thread on a shared machine: what a quiet machine would show).

    python bench/cpu_vs_hf.py                      # the issue's workload (about 10 minutes on 2 cores)
    python bench/cpu_vs_hf.py --quick              # tiny smoke run (< 1 minute)
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python bench/cpu_vs_hf.py   # as on an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import common  # noqa: E402

FULL = dict(hidden=1024, intermediate=3840, layers=8, heads=16, kv_heads=4, experts=8, top_k=2, vocab=4096)
QUICK = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, experts=8, top_k=2, vocab=1024)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=None, help="number of requests (default 256; 16 with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny model and workload, a smoke run under a minute")
    p.add_argument("--batch", type=int, default=None, help="our engine's batch size (default 64; 8 with --quick)")
    p.add_argument("--micro-batch", type=int, default=None, help="our micro-batch size (default: the batch)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for both systems (default: the cores other work leaves free)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: time by this process's CPU seconds (with --threads 1 on a shared machine)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="our engine's weights (default: the checkpoint's bf16; float32 widens them at load, the "
                        "baseline a bf16 checkpoint under the AVX2 limits is compared with)")
    p.add_argument("--hf-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="transformers' dtype (auto: bf16 where the CPU runs it natively, else fp32)")
    p.add_argument("--single-tokens", type=int, default=None,
                   help="new tokens of the batch-1 decode measurement (default 64; 16 with --quick; 0 skips it)")
    p.add_argument("--skip-batch", action="store_true", help="skip the batched workload (batch-1 only)")
    p.add_argument("--workdir", type=Path, default=None, help="where to build the model (default: a temp dir)")
    p.add_argument("--max-new-tokens", default=None, help="comma list the requests cycle through (default 32,64,96,128)")
    p.add_argument("--hf-impls", default=None, help="experts_implementation values to try (default eager,grouped_mm; batched_mm gathers a weight "
                   "copy per routed token: 130x slower than grouped_mm in --quick and > 12 GB RSS on the full model)")
    p.add_argument("--hf-batches", default=None, help="transformers batch sizes to try (default 16,32,64)")
    p.add_argument("--hf-probe", type=int, default=None, help="requests in the transformers tuning probe (default 32)")
    p.add_argument("--hf-probe-tokens", type=int, default=16, help="max_new_tokens in the tuning probe")
    p.add_argument("--hf-setting", default=None, help="skip tuning: IMPL:BATCH, e.g. grouped_mm:64")
    p.add_argument("--skip-hf", action="store_true", help="run our engine only")
    p.add_argument("--json", type=Path, default=None, help="write all figures to this JSON file")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    q = a.quick
    a.requests = a.requests or (16 if q else 256)
    a.batch = a.batch or (8 if q else 64)
    a.micro_batch = a.micro_batch or a.batch
    a.max_new_tokens = [int(x) for x in (a.max_new_tokens or ("8,16" if q else "32,64,96,128")).split(",")]
    a.hf_impls = (a.hf_impls or "eager,grouped_mm").split(",")
    a.hf_batches = [int(x) for x in (a.hf_batches or ("4,8" if q else "16,32,64")).split(",")]
    a.hf_probe = a.hf_probe or (8 if q else 32)
    a.single_tokens = (16 if q else 64) if a.single_tokens is None else a.single_tokens
    if q:
        a.hf_probe_tokens = min(a.hf_probe_tokens, 8)
    return a


# ---- our engine ------------------------------------------------------------------------------------
class _Recorder:
    """Notes each step's shape (requests, Σ cached tokens) for the roofline, by wrapping the methods of the
    runner the engine makes (`Engine.runner(...)`, with `decode(tokens, slots, positions, ...)` and
    `prefill(prompts, ...)`); it changes nothing the engine computes."""

    def __init__(self):
        self.decode: list[tuple[int, int]] = []  # (requests, Σ cached lengths incl. the new token)
        self.prefill: list[list[int]] = []  # prompt lengths of each prefill wave
        self.events: list = []
        self.shapes_known = False

    def install(self, engine):
        make = getattr(engine, "runner", None)
        if make is None:  # another engine layout: the roofline falls back to the events alone
            return lambda: None
        rec = self

        def runner(*a, **kw):
            r = make(*a, **kw)
            dec, pre = r.decode, r.prefill

            def decode(tokens, slots, positions, *rest, **kw2):
                rec.decode.append((sum(len(t) for t in tokens), sum(p + 1 for ps in positions for p in ps)))
                return dec(tokens, slots, positions, *rest, **kw2)

            def prefill(prompts, *rest, **kw2):
                rec.prefill.append([len(p) for p in prompts])
                return pre(prompts, *rest, **kw2)

            r.decode, r.prefill = decode, prefill
            rec.shapes_known = True
            return r

        engine.runner = runner
        return lambda: engine.__dict__.pop("runner", None)

    def sink(self, ev):
        if type(ev).__name__ == "StepDone":
            self.events.append((ev.kind, ev.tokens, ev.seconds))


def run_ours(model_dir: Path, requests, batch: int, micro: int, threads: int, dtype: str | None = None):
    from core.runtime.engine import Engine, Request

    from core.runtime.calibrate import StepClock

    t = time.perf_counter()
    engine = Engine.load(model_dir, device="cpu", threads=threads, dtype=dtype)  # the CPU mode, even on a machine with a GPU
    load_s = time.perf_counter() - t
    list(engine.generate([Request("w0", prompt=requests[0].prompt, max_new_tokens=4),
                          Request("w1", prompt=requests[-1].prompt, max_new_tokens=4)], batch_size=2))  # warm-up
    rec = _Recorder()
    restore = rec.install(engine)
    try:
        sink = StepClock(engine, common.clock, forward=rec.sink)
        t, c = common.clock(), common.cpu_seconds()
        results = list(engine.generate(requests, batch_size=batch, micro_batch_size=micro, on_event=sink))
        wall, cpu = common.clock() - t, common.cpu_seconds() - c
    finally:
        restore()
    spec = engine.spec
    del engine
    gc.collect()
    return {"wall": wall, "cpu": cpu, "load_s": load_s, "results": {r.id: r for r in results}, "rec": rec, "spec": spec}


# ---- transformers ------------------------------------------------------------------------------------
def hf_batches(prompt_ids: dict, mnt: dict, ids: list[str], batch: int):
    """Requests sharing a max_new_tokens value, longest prompt first, in chunks of `batch`."""
    by_m: dict[int, list[str]] = {}
    for i in ids:
        by_m.setdefault(mnt[i], []).append(i)
    for m in sorted(by_m, reverse=True):
        group = sorted(by_m[m], key=lambda i: -len(prompt_ids[i]))
        for lo in range(0, len(group), batch):
            yield m, group[lo:lo + batch]


def run_hf(model, prompt_ids: dict, mnt: dict, ids: list[str], batch: int, pad: int, eos: int):
    outs = {}
    t, c = common.clock(), common.cpu_seconds()
    for m, chunk in hf_batches(prompt_ids, mnt, ids, batch):
        n = max(len(prompt_ids[i]) for i in chunk)
        inp = torch.full((len(chunk), n), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), n), dtype=torch.long)
        for r, i in enumerate(chunk):
            p = prompt_ids[i]
            inp[r, n - len(p):] = torch.tensor(p)
            mask[r, n - len(p):] = 1
        with torch.inference_mode():
            gen = model.generate(input_ids=inp, attention_mask=mask, max_new_tokens=m, min_new_tokens=0,
                                 do_sample=False, use_cache=True, pad_token_id=pad, eos_token_id=eos)
        for r, i in enumerate(chunk):
            toks = gen[r, n:].tolist()
            outs[i] = toks[:toks.index(eos)] if eos in toks else toks
    wall, cpu = common.clock() - t, common.cpu_seconds() - c
    run_hf.cpu = cpu
    return wall, outs


def hf_dtype(choice: str) -> torch.dtype:
    """transformers' best dtype here: bf16 where the CPU runs bf16 matmuls natively, fp32 elsewhere."""
    if choice != "auto":
        return getattr(torch, choice)
    from core.model.cpu.isa import cpu_isa

    return torch.bfloat16 if cpu_isa().bf16_native else torch.float32


def load_hf(model_dir: Path, dtype: torch.dtype = torch.bfloat16):
    from transformers import MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    model = MixtralForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa")
    model.generation_config.max_length = None
    return model.eval()


def set_impl(model, impl: str) -> bool:
    try:
        model.set_experts_implementation(impl)
        return True
    except Exception as e:  # not available on this torch / device
        print(f"  transformers experts_implementation={impl}: unavailable ({str(e).splitlines()[0]})")
        return False


def tune_hf(model, prompt_ids, ids, args, pad, eos):
    """Pick (experts_implementation, batch) by tokens/s on a probe of the workload's requests."""
    rng = random.Random(args.seed + 7)
    probe = rng.sample(ids, min(args.hf_probe, len(ids)))
    pm = {i: args.hf_probe_tokens for i in probe}
    trials = []

    def trial(impl, b):
        if not set_impl(model, impl):
            return None
        run_hf(model, prompt_ids, pm, probe[:2], 2, pad, eos)  # warm-up this implementation
        wall, outs = run_hf(model, prompt_ids, pm, probe, b, pad, eos)
        tps = sum(len(v) for v in outs.values()) / wall
        trials.append({"impl": impl, "batch": b, "tok_s": tps})
        print(f"  probe: experts_implementation={impl:<11} batch={b:<4} {tps:8.1f} tok/s", flush=True)
        return tps

    b0 = args.hf_batches[len(args.hf_batches) // 2]
    scores = {impl: trial(impl, b0) for impl in args.hf_impls}
    best_impl = max((i for i in scores if scores[i]), key=lambda i: scores[i])
    bs = {b0: scores[best_impl]}
    for b in args.hf_batches:
        if b != b0:
            bs[b] = trial(best_impl, b)
    best_b = max(bs, key=lambda b: bs[b])
    return best_impl, best_b, trials


# ---- roofline ------------------------------------------------------------------------------------------
def roofline_fraction(spec, rec: _Recorder, roof: common.Roofline) -> dict:
    dec_s = [s for k, _, s in rec.events if k == "decode"]
    pre_s = [s for k, _, s in rec.events if k == "prefill"]
    if not rec.shapes_known:  # no cached lengths: count weights only (KV read taken as 0, flattering us)
        rec.decode = [(n, 0) for k, n, _ in rec.events if k == "decode"]
        rec.prefill = [[n] for k, n, _ in rec.events if k == "prefill"]
    assert len(dec_s) == len(rec.decode) and len(pre_s) == len(rec.prefill), "step records out of step"
    ideal_dec = sum(roof.time(*common.decode_step_cost(spec, b, ctx)) for b, ctx in rec.decode)
    ideal_pre = sum(roof.time(*common.prefill_cost(spec, ls)) for ls in rec.prefill)
    dec_flops = sum(common.decode_step_cost(spec, b, ctx)[0] for b, ctx in rec.decode)
    dec_bytes = sum(common.decode_step_cost(spec, b, ctx)[1] for b, ctx in rec.decode)
    toks = sum(b for b, _ in rec.decode)
    by_batch: dict[str, list[float]] = {}  # where the fraction is lost: [steps, ideal s, measured s] per batch
    for (b, ctx), s in zip(rec.decode, dec_s):
        row = by_batch.setdefault(f"{(b + 15) // 16 * 16}", [0, 0.0, 0.0])
        row[0] += 1
        row[1] += roof.time(*common.decode_step_cost(spec, b, ctx))
        row[2] += s
    return {
        "decode_steps": len(dec_s), "decode_tokens": toks, "decode_s": sum(dec_s), "prefill_s": sum(pre_s),
        "decode_ideal_s": ideal_dec, "prefill_ideal_s": ideal_pre,
        "decode_fraction": ideal_dec / sum(dec_s) if dec_s else float("nan"),
        "prefill_fraction": ideal_pre / sum(pre_s) if pre_s else float("nan"),
        "decode_mean_batch": toks / max(1, len(dec_s)),
        "decode_intensity_flop_per_byte": dec_flops / dec_bytes if dec_bytes else float("nan"),
        "decode_achieved_gflops": dec_flops / sum(dec_s) / 1e9 if dec_s else float("nan"),
        "decode_achieved_gbs": dec_bytes / sum(dec_s) / 1e9 if dec_s else float("nan"),
        "decode_by_batch": dict(sorted(by_batch.items(), key=lambda kv: int(kv[0]))),
    }


# ---- main ------------------------------------------------------------------------------------------------
def single_stream(model_dir: Path, tok, prompt: str, new: int, threads: int, hf_model, roof: common.Roofline,
                  dtype: str | None = None) -> dict:
    """Batch-1 decode: one request, `new` tokens. Ours: decode steps' seconds from the engine's events;
    transformers: generate(new + 1) minus generate(1) (its prefill), over `new` decode tokens."""
    from core.runtime.calibrate import StepClock
    from core.runtime.engine import Engine, Request

    engine = Engine.load(model_dir, threads=threads, dtype=dtype)
    engine.eos_ids = set()
    list(engine.generate([Request("w", prompt=prompt, max_new_tokens=4)]))  # warm-up
    sink = StepClock(engine, common.clock)
    (res,) = engine.generate([Request("s", prompt=prompt, max_new_tokens=new + 1)], batch_size=1, on_event=sink)
    dec = [e for e in sink.steps if e.kind == "decode"]
    ours = sum(e.tokens for e in dec) / sum(e.seconds for e in dec)
    spec = engine.spec
    del engine
    gc.collect()
    # the bound: every decode token reads the non-expert weights, top-k experts per layer and the LM head
    active = spec.num_layers * (spec.layer_nonexpert_bytes + spec.top_k * spec.expert_bytes)
    active += spec.vocab_size * spec.hidden_size * spec.dtype_bytes
    out = {"single_new_tokens": new, "single_ours_tok_s": ours, "single_bound_tok_s": roof.bandwidth / active,
           "single_active_gb": active / 1e9, "single_ours_tokens": res.output_tokens}
    if hf_model is not None:
        ids = torch.tensor([tok(prompt).input_ids])
        eos = tok.eos_token_id

        def gen(n):
            with torch.inference_mode():
                hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, use_cache=True, pad_token_id=tok.pad_token_id, eos_token_id=eos)

        gen(4)  # warm-up
        t = common.clock()
        gen(1)
        pre = common.clock() - t
        t = common.clock()
        gen(new + 1)
        out["single_hf_tok_s"] = new / max(1e-9, common.clock() - t - pre)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.clock == "cpu":
        common.use_cpu_clock()
    if args.threads is None:
        from core.platform import free_cores

        args.threads = free_cores()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from core.runtime.engine import Request
    from core.model.cpu.isa import cpu_isa
    from core.model.families import load_spec

    shape = QUICK if args.quick else FULL
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="mlight-bench-")
        work = Path(tmp.name)
    else:
        work = args.workdir
    model_dir = work / ("mixtral-quick" if args.quick else "mixtral-800m")
    from core.model.cpu import compute, ffn, native, panel_linear, row_ops

    bf16_math = compute.choose(args.dtype or "bfloat16").math  # what the checkpoint computes in here
    print(f"mlight bench cpu_vs_hf: torch {torch.__version__}, {args.threads} threads, {platform.processor() or platform.machine()} "
          f"({cpu_isa().label}), {args.clock} clock, load average {common.load_average()}; decode attention: "
          f"{native.status()}; bf16 experts: {ffn.status(bf16_math)}; bf16 projections: "
          f"{panel_linear.status(bf16_math)}; row ops: {row_ops.status()}", flush=True)
    t = time.perf_counter()
    if not (model_dir / "config.json").is_file():
        info = common.build_mixtral(model_dir, **shape, seed=args.seed)
        print(f"built {model_dir.name}: {info['params'] / 1e6:.0f}M params, vocab {info['vocab']}, bf16 "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
    spec = load_spec(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    lengths = common.target_lengths(args.requests, mean=20 if args.quick else 77, max_len=60 if args.quick else 418)
    prompts = common.build_prompts(tok, lengths, seed=args.seed)
    rng = random.Random(args.seed)
    reqs = [Request(f"r{i:04d}", prompt=p, max_new_tokens=rng.choice(args.max_new_tokens)) for i, p in enumerate(prompts)]
    prompt_ids = {r.id: list(tok(r.prompt).input_ids) for r in reqs}
    mnt = {r.id: r.max_new_tokens for r in reqs}
    plen = [len(v) for v in prompt_ids.values()]
    want = sum(mnt.values())
    print(f"workload: {len(reqs)} requests, prompt tokens mean {sum(plen) / len(plen):.1f} max {max(plen)} min {min(plen)}, "
          f"max_new_tokens in {args.max_new_tokens} (sum {want})", flush=True)

    def measure():
        return common.measure_roofline(sizes=(512, 1024) if args.quick else (2048, 4096),
                                       bw_bytes=(1 << 28) if args.quick else (1 << 30))

    roof = measure()
    print(f"machine: peak matmul {roof.flops / 1e9:.0f} GFLOP/s "
          f"({', '.join(f'{n}³ {v / 1e9:.0f}' for n, v in roof.gemm_detail.items())}), read bandwidth "
          f"{roof.bandwidth / 1e9:.1f} GB/s ({', '.join(f'{k} sum {v / 1e9:.1f}' for k, v in roof.bw_detail.items())}), "
          f"ridge {roof.flops / roof.bandwidth:.0f} FLOP/B", flush=True)

    out = {"command": "python bench/cpu_vs_hf.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "threads": args.threads, "clock": args.clock, "isa": cpu_isa().label, "torch": torch.__version__,
           "dtype": args.dtype or "bfloat16", "decode_attention": native.status(), "experts_kernel": ffn.status(bf16_math),
           "row_ops": row_ops.status(), "projections": panel_linear.status(bf16_math),
           "params": spec.num_params, "active_params": spec.active_params, "requests": len(reqs),
           "prompt_mean": sum(plen) / len(plen), "prompt_max": max(plen), "requested_tokens": want,
           "peak_flops": roof.flops, "bandwidth": roof.bandwidth, "gemm_detail": roof.gemm_detail,
           "bw_detail": roof.bw_detail, "load_avg_start": common.load_average()}

    if not args.skip_batch:
        ours = run_ours(model_dir, reqs, args.batch, args.micro_batch, args.threads, args.dtype)
        got = sum(r.output_tokens for r in ours["results"].values())
        ours_tps = got / ours["wall"]
        before, after = roof, measure()
        roof = before.at_best(after)  # the machine's peak is the higher of two looks, never the lower
        print(f"machine after the run: peak matmul {after.flops / 1e9:.0f} GFLOP/s, read bandwidth "
              f"{after.bandwidth / 1e9:.1f} GB/s; the roofline uses the higher of each: {roof.flops / 1e9:.0f} GFLOP/s, "
              f"{roof.bandwidth / 1e9:.1f} GB/s", flush=True)
        out.update({"peak_flops_before": before.flops, "peak_flops_after": after.flops, "peak_flops": roof.flops,
                    "bandwidth_before": before.bandwidth, "bandwidth_after": after.bandwidth,
                    "bandwidth": roof.bandwidth})
        rf = roofline_fraction(ours["spec"], ours["rec"], roof)
        print(f"ours:  {got} tokens in {ours['wall']:.1f} s = {ours_tps:.1f} tok/s  ({args.dtype or 'bfloat16'} weights, batch {args.batch}, micro-batch "
              f"{args.micro_batch}; prefill {rf['prefill_s']:.1f} s, decode {rf['decode_s']:.1f} s over {rf['decode_steps']} "
              f"steps, mean batch {rf['decode_mean_batch']:.1f}; CPU time {ours['cpu']:.1f} s = "
              f"{ours['cpu'] / ours['wall'] / args.threads * 100:.0f} % of {args.threads} core(s) × {args.clock})", flush=True)
        print(f"roofline (decode): {rf['decode_fraction'] * 100:.1f} % (ideal {rf['decode_ideal_s']:.1f} s vs "
              f"{rf['decode_s']:.1f} s; intensity {rf['decode_intensity_flop_per_byte']:.0f} FLOP/B, achieved "
              f"{rf['decode_achieved_gflops']:.0f} GFLOP/s, {rf['decode_achieved_gbs']:.1f} GB/s); prefill "
              f"{rf['prefill_fraction'] * 100:.1f} %; end to end "
              f"{(rf['decode_ideal_s'] + rf['prefill_ideal_s']) / ours['wall'] * 100:.1f} %", flush=True)
        print("roofline by batch (up to, steps, fraction, share of decode): " + "; ".join(
            f"{b}: {n}, {i / m * 100:.0f} %, {m / rf['decode_s'] * 100:.0f} %"
            for b, (n, i, m) in rf["decode_by_batch"].items()), flush=True)
        out.update({"ours_tokens": got, "ours_wall": ours["wall"], "ours_tok_s": ours_tps, "ours_cpu_s": ours["cpu"],
                    "batch": args.batch, "micro_batch": args.micro_batch, **{f"ours_{k}": v for k, v in rf.items()}})

    model = None
    if not args.skip_hf:
        dtype = hf_dtype(args.hf_dtype)
        model = load_hf(model_dir, dtype)
        out["hf_dtype"] = str(dtype).removeprefix("torch.")
    if not args.skip_hf and not args.skip_batch:
        pad, eos = tok.pad_token_id, tok.eos_token_id
        ids = [r.id for r in reqs]
        if args.hf_setting:
            impl, b = args.hf_setting.split(":")
            b, trials = int(b), []
        else:
            print("tuning transformers on a probe "
                  f"({args.hf_probe} requests × {args.hf_probe_tokens} new tokens, sdpa, use_cache=True):", flush=True)
            impl, b, trials = tune_hf(model, prompt_ids, ids, args, pad, eos)
        set_impl(model, impl)
        run_hf(model, prompt_ids, mnt, ids[:2], 2, pad, eos)  # warm-up
        wall, outs = run_hf(model, prompt_ids, mnt, ids, b, pad, eos)
        hf_got = sum(len(v) for v in outs.values())
        hf_tps = hf_got / wall
        same = sum(outs[i] == ours["results"][i].output_token_ids for i in ids) / len(ids)
        print(f"hf:    {hf_got} tokens in {wall:.1f} s = {hf_tps:.1f} tok/s  ({out['hf_dtype']}, experts_implementation="
              f"{impl}, batch {b}, sdpa, use_cache=True, left-padded, grouped by max_new_tokens, sorted by length; CPU "
              f"time {run_hf.cpu:.1f} s = {run_hf.cpu / wall / args.threads * 100:.0f} % of {args.threads} core(s) × "
              f"{args.clock})", flush=True)
        print(f"ratio: {ours_tps / hf_tps:.2f}× transformers; identical greedy outputs for {same * 100:.0f} % of requests",
              flush=True)
        out.update({"hf_impl": impl, "hf_batch": b, "hf_trials": trials, "hf_tokens": hf_got, "hf_wall": wall,
                    "hf_tok_s": hf_tps, "hf_cpu_s": run_hf.cpu, "ratio": ours_tps / hf_tps, "identical_outputs": same})
    if args.single_tokens:
        single = single_stream(model_dir, tok, prompts[len(prompts) // 2], args.single_tokens, args.threads, model, roof,
                               args.dtype)
        hf = f", transformers {single['single_hf_tok_s']:.1f} tok/s ({single['single_ours_tok_s'] / single['single_hf_tok_s']:.2f}×)" \
            if "single_hf_tok_s" in single else ""
        print(f"batch 1: ours {single['single_ours_tok_s']:.1f} tok/s decode{hf}; bound {single['single_bound_tok_s']:.1f} "
              f"tok/s ({single['single_active_gb']:.2f} GB of active weights per token at {roof.bandwidth / 1e9:.1f} GB/s)",
              flush=True)
        out.update(single)
    del model
    out["load_avg_end"] = common.load_average()
    print(f"load average at the end: {out['load_avg_end']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
