"""The GPU check: a few minutes on a real GPU, staged so that a cut-off run still leaves every figure
it got. Run it under `timeout` with its own deadline a little shorter:

    timeout 540 python bench/gpu_check.py --deadline 480 --out "$OUT"      # on the GPU machine
    python bench/gpu_check.py --dry-run --out /tmp/gc                       # anywhere: the emulated GPU

Stages, in order; each is skipped (and says so) when too little of the deadline is left, and each
writes gpu_check.json and gpu_check.txt (a short table) into --out as soon as it finishes:
  smoke    one tiny model through the CUDA executor: tokens equal the CPU engine's (≈ 30 s at most)
  parity   every family × schedule (CGOPipe, S3, S4) × paging on the GPU against the CPU engine
  offload  a Mixtral-shaped bf16 model larger than a memory cap (16 GB = a T4, 24 GB = an L4, set with
           torch.cuda.set_per_process_memory_fraction): the planner's policy for the cap, tokens/s of
           CGOPipe, S3 and S4 under it with measured vs predicted busy time per resource and peak GPU
           memory vs the plan's; then HF accelerate offload (device_map="auto", max_memory at the cap)
           on the same model, started only once our runs have given their memory back
  pcie     host↔device bandwidth through memory page-locked the way the runtime does it, and host→device
           from pageable memory (what streaming past the pinned budget, core.platform.pinned_budget, gets)
  host     the executor's host cost per task and per op on this machine (the planner's TASK_SECONDS
           and OP_SECONDS)
  multi    (with --multi-gpu) tensor-parallel scaling over this machine's GPUs (bench/multi_gpu.py)
`--dry-run` runs the same code on the emulated device (core.runtime.device_emulated) with tiny
models and caps scaled to the model, so CI proves the script end to end; its figures are not speeds.
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
import traceback
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
MIXTRAL_LAYER_BYTES = 2 * (3 * 8 * 4096 * 14336 + 4096 * (4096 + 2 * 1024 + 4096) + 8 * 4096)  # bf16
PROMPTS = ["Hi", "Compose an engaging travel blog post about Hawaii.", "x y z", "What is 2+2? Explain.",
           "Draft an email to a colleague.", "Tell me a story about a cat and a dog"]
# seconds a stage needs at least to be worth starting, and at most may take (the deadline caps both)
STAGES = {"smoke": (20, 60), "parity": (30, 120), "offload": (90, 400), "pcie": (5, 30), "host": (5, 30),
          "multi": (60, 300)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="the emulated GPU and tiny models (CI)")
    p.add_argument("--out", type=Path, default=None, help="folder for gpu_check.json/.txt (default $OUT or .)")
    p.add_argument("--deadline", type=float, default=480.0, help="seconds for the whole check (default 480)")
    p.add_argument("--stages", default=None, help=f"comma-separated subset of {', '.join(STAGES)} (default: all "
                   "but multi, which --multi-gpu adds)")
    p.add_argument("--layers", type=int, default=None, help="layers of the offload model (default 10 ≈ 29 GB; 4 dry)")
    p.add_argument("--caps", default="16,24", help="GPU memory caps in GB (default 16,24: a T4 and an L4)")
    p.add_argument("--requests", type=int, default=None, help="requests per offload run (default 128; 8 dry)")
    p.add_argument("--gen-len", type=int, default=None, help="tokens per request (default 16; 4 dry)")
    p.add_argument("--hf-requests", type=int, default=None, help="requests for the accelerate baseline (8; 2 dry)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--workdir", type=Path, default=None, help="where models are built (default: a temp dir)")
    p.add_argument("--multi-gpu", action="store_true",
                   help="also the multi stage: tensor-parallel scaling over this machine's GPUs (bench/multi_gpu.py)")
    a = p.parse_args(argv)
    a.layers = a.layers or (4 if a.dry_run else 10)
    a.requests = a.requests or (8 if a.dry_run else 128)
    a.gen_len = a.gen_len or (4 if a.dry_run else 16)
    a.hf_requests = a.hf_requests or (2 if a.dry_run else 8)
    a.caps = [float(c) for c in a.caps.split(",")]
    a.stages = [s.strip() for s in a.stages.split(",") if s.strip()] if a.stages else [
        s for s in STAGES if s != "multi" or a.multi_gpu]
    unknown = set(a.stages) - set(STAGES)
    if unknown:
        p.error(f"unknown stage(s) {', '.join(sorted(unknown))}; choose from {', '.join(STAGES)}")
    a.out = a.out or Path(os.environ.get("OUT", "."))
    return a


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Check:
    """Shared state of the run: the deadline, the device factory, and the report written after each stage."""

    def __init__(self, args):
        self.args, self.dry = args, args.dry_run
        self.start = time.monotonic()
        self.deadline = self.start + args.deadline
        self.work = args.workdir or Path(tempfile.mkdtemp(prefix="mlight-gpu-check-"))
        self.devices: list = []  # dry: every emulated GPU made, to read what is still allocated on them
        self.report = {"device": "emulated GPU (dry run)" if self.dry else torch.cuda.get_device_name(0),
                       "torch": torch.__version__, "dry_run": self.dry, "deadline_s": args.deadline,
                       "args": {k: str(v) for k, v in vars(args).items()}, "stages": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def device(self, cap_bytes: int | None = None):
        """A fresh device for one engine: the emulated GPU (its memory = the cap), or CUDA."""
        if self.dry:
            from core.runtime.device_emulated import EmulatedCuda

            dev = EmulatedCuda(cap_bytes or (1 << 34))
            self.devices.append(dev)
            return dev
        return "cuda"

    def save(self, name: str, result: dict) -> None:
        self.report["stages"][name] = result
        self.report["seconds"] = round(time.monotonic() - self.start, 1)
        out = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=1, default=str), encoding="utf-8")
        tmp.replace(out / "gpu_check.json")  # a reader never sees half a file
        (out / "gpu_check.txt").write_text(table(self.report) + "\n", encoding="utf-8")


# ---- stages -------------------------------------------------------------------------------------------
def requests(n: int, new: int) -> list[Request]:
    return [Request(id=str(i), prompt=PROMPTS[i % len(PROMPTS)], max_new_tokens=new) for i in range(n)]


def tokens(engine: Engine, reqs, until: float | None = None, **kw) -> dict:
    stop = (lambda: time.monotonic() > until) if until else None
    return {r.id: r.output_token_ids for r in engine.generate(reqs, should_stop=stop, **kw)}


def cpu_reference(path: Path, reqs) -> dict:
    ref = Engine.load(path, device="cpu")  # named: on a GPU machine the default would be the GPU
    ref.eos_ids = set()
    return tokens(ref, reqs, batch_size=4, micro_batch_size=2)


def tiny_model(c: Check, family: str) -> Path:
    from checkpoints import make_checkpoint

    path = c.work / f"tiny-{family}"
    if not (path / "config.json").is_file():
        layers = dict(n_layers=3) if family == "dbrx" else dict(num_hidden_layers=3)
        make_checkpoint(family, path, **layers)
    return path


def on_device(c: Check, path: Path, reqs, until: float, notes: list | None = None, **load) -> dict:
    """Tokens of `reqs` through the CUDA executor; `notes` gets the device's failed runtime calls."""
    engine = Engine.load(path, device=c.device(), executor="cuda", **load)
    engine.eos_ids = set()
    try:
        return tokens(engine, reqs, until, batch_size=4, micro_batch_size=2)
    finally:
        engine.close()
        if notes is not None:
            notes += getattr(engine.dev, "runtime_errors", [])


def pending_error(c: Check) -> str | None:
    """A CUDA error left pending (not raised where it happened) after an engine closed; None dry."""
    if c.dry:
        return None
    from core.runtime.device import resolve_device

    return resolve_device("cuda").pending_error()


def stage_smoke(c: Check, until: float) -> dict:
    t0 = time.monotonic()
    path, reqs = tiny_model(c, "mixtral"), requests(6, 6)
    want = cpu_reference(path, reqs)
    got = on_device(c, path, reqs, until, schedule="cgopipe", pages_per_layer=2, resident_layers=1)
    return {"equal": got == want, "requests": len(got), "seconds": round(time.monotonic() - t0, 1)}


PAGINGS = {"streamed": dict(pages_per_layer=1, resident_layers=0), "paged+resident": dict(pages_per_layer=3,
                                                                                         resident_layers=1)}


def stage_parity(c: Check, until: float) -> dict:
    from checkpoints import FAMILIES

    rows = []
    for fam in FAMILIES:
        try:
            path, reqs = tiny_model(c, fam), requests(6, 6)
            want = cpu_reference(path, reqs)
        except Exception as e:  # noqa: BLE001 - a family this machine's transformers cannot build: say so, go on
            rows.append({"family": fam, "schedule": "-", "paging": "-", "equal": False,
                         "error": f"reference: {type(e).__name__}: {str(e)[:200]}"})
            continue
        # dry: every family through CGOPipe and one through all schedules, one paging (CI runs every
        # combination on the emulated GPU in tests/test_cuda_executor.py)
        for schedule in ("cgopipe", "s3", "s4") if not c.dry or fam == "mixtral" else ("cgopipe",):
            for paging, kw in list(PAGINGS.items())[1 if c.dry else 0:]:
                if time.monotonic() > until:
                    return {"rows": rows, "cut_short": True}
                row, notes = {"family": fam, "schedule": schedule, "paging": paging}, []
                try:  # one combination failing is a row of the result, not the end of the stage
                    row["equal"] = on_device(c, path, reqs, until, notes, schedule=schedule, **kw) == want
                except Exception as e:  # noqa: BLE001
                    row.update(equal=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                pending = pending_error(c)
                if pending or notes:
                    row.update(pending_after=pending, runtime_errors=notes)
                rows.append(row)
                log(f"parity {fam:9} {schedule:7} {paging:14} {'OK' if row['equal'] else 'MISMATCH'} "
                    f"{row.get('error', '')} {pending or ''} {' '.join(notes)}")
    return {"rows": rows, "cut_short": False}


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
    bank = (torch.randn(1 << 24, generator=g) * 0.02).to(torch.bfloat16)

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


def plan_for_cap(c: Check, spec, cap_bytes: int, work, host: dict | None = None):
    """The planner's policy and prediction for this model with the GPU capped at `cap_bytes`; `host`: the
    host stage's measured costs per task and per op, in place of the planner's constants."""
    from core.plan.hardware import resolve
    from core.plan.planner import Budget, plan

    hw = resolve("local")
    if host:
        hw = dataclasses.replace(hw, host_task_seconds=host["task_seconds"], host_op_seconds=host["op_seconds"])
    pcie = c.report["stages"].get("pcie", {})
    if pcie.get("h2d_gbps") and not c.dry:
        hw = dataclasses.replace(hw, h2d_bw=pcie["h2d_gbps"] * 1e9, d2h_bw=pcie["d2h_gbps"] * 1e9,
                                 measured=tuple(sorted(set(hw.measured) | {"h2d_bw", "d2h_bw"})))
    if c.dry:  # the CPU plays a GPU ten times its speed, behind a link as fast as its memory
        hw = dataclasses.replace(hw, gpu_name="emulated GPU", gpu_count=1, gpu_mem_bytes=cap_bytes,
                                 gpu_flops=10 * hw.cpu_flops, gpu_bw=10 * hw.cpu_bw, h2d_bw=hw.cpu_bw,
                                 d2h_bw=hw.cpu_bw)
    hw = dataclasses.replace(hw, gpu_mem_bytes=cap_bytes, gpu_mem_free_bytes=None,
                             gpu_count=min(1, hw.gpu_count))  # the check runs one GPU
    budget = Budget(gpu_bytes=cap_bytes, cpu_bytes=int(0.8 * hw.cpu_mem_bytes))
    return (*plan(spec, hw, work, budget, ranks=1), hw)  # one process on one GPU


def gpu_policy(spec, hw, work, cap: int):
    """The most resident experts that fit, with the FFN on the GPU (dry runs only)."""
    from core.plan.planner import Budget, predict, validate
    from core.plan.policy import Policy

    n = min(8, work.num_requests)
    for r_w in (0.5, 0.25, 0.0):
        policy = Policy(n, max(1, n // 2), max(1, n // 2), "cpu", "gpu", r_w, 0.0, 2)
        if not validate(policy, spec, hw, work, Budget(cap, int(0.8 * hw.cpu_mem_bytes))) or r_w == 0.0:
            return policy, predict(policy, spec, hw, work)


def variants(c: Check, spec, cap: int, work, policy, pred, hw) -> list[tuple[str, str, object, object]]:
    """(name, schedule, policy, prediction) to run at one cap: the planner's policy; the planner's policy with
    this machine's measured host costs (the host stage), where it differs; that policy at larger micro-batches
    (what the host bound trades against); S4 and S3 at it."""
    from core.plan.planner import Budget, predict, validate

    out = [("planner", "cgopipe", policy, pred)]
    host = c.report["stages"].get("host", {})
    if host.get("task_seconds") and policy.ffn_on == "gpu":
        p2, pred2, hw = plan_for_cap(c, spec, cap, work, host)
        if p2.ffn_on == "gpu":
            if p2 != policy:
                out.append(("planner, measured host", "cgopipe", p2, pred2))
            policy, pred = p2, pred2
        budget = Budget(gpu_bytes=cap, cpu_bytes=int(0.8 * hw.cpu_mem_bytes))
        for mu in (4 * policy.micro_batch_size, 16 * policy.micro_batch_size):
            if mu > policy.micro_batch_size and policy.batch_size % mu == 0:
                eb = max(mu, policy.expert_batch_size)
                # a larger micro-batch's prefill activations take room: fewer resident experts where needed
                fits = [p for rw in (policy.gpu_weight_fraction, policy.gpu_weight_fraction / 2, 0.0)
                        for p in [dataclasses.replace(policy, micro_batch_size=mu, expert_batch_size=eb,
                                                      gpu_weight_fraction=rw)]
                        if policy.batch_size % eb == 0 and not validate(p, spec, hw, work, budget)]
                if fits:
                    out.append((f"mu={mu}", "cgopipe", fits[0], predict(fits[0], spec, hw, work)))
    return out + [("at the policy above", "s4", policy, pred), ("at the policy above", "s3", policy, pred)]


def run_schedule(c: Check, path: Path, layers: int, policy, schedule: str, reqs, cap_bytes: int, until: float) -> dict:
    dev = c.device(cap_bytes)
    t_load = time.perf_counter()
    engine = Engine.load(path, device=dev, executor="cuda", policy=policy, schedule=schedule)
    load = time.perf_counter() - t_load
    engine.eos_ids = set()
    if not c.dry:
        torch.cuda.reset_peak_memory_stats()
    events: list[StepDone] = []
    first: list[float] = []

    def on_event(e):
        if isinstance(e, StepDone):
            events.append(e)
            if not first:
                first.append(time.perf_counter())

    t0 = time.perf_counter()
    try:
        results = list(engine.generate(reqs, on_event=on_event, should_stop=lambda: time.monotonic() > until))
    finally:
        engine.close()
    wall = time.perf_counter() - t0
    peak = engine.dev.max_memory_allocated()
    del engine
    gc.collect()
    decode = [e for e in events if e.kind == "decode"]
    dsec = sum(e.seconds for e in decode) or 1e-9
    tokens_out = sum(r.output_tokens for r in results)
    prefill = [e for e in events if e.kind != "decode"]
    return {"schedule": schedule, "requests_done": len(results), "tokens": tokens_out, "seconds": round(wall, 2),
            "tokens_per_s": tokens_out / wall, "decode_tokens_per_s": sum(e.tokens for e in decode) / dsec,
            "load_seconds": round(load, 2), "first_step_after_s": round(first[0] - t0, 2) if first else None,
            "prefill_seconds": round(sum(e.seconds for e in prefill), 2), "decode_seconds": round(dsec, 2),
            "decode_steps": len(decode), "decode_step_ms": 1e3 * dsec / max(1, len(decode)),
            "layer_seconds": {r: sum(e.busy.get(r, 0.0) for e in decode) / max(1, len(decode)) / layers
                              for r in RESOURCES},
            "peak_gpu_bytes": peak, "cut_short": time.monotonic() > until}


def hf_offload(c: Check, path: Path, cap_bytes: int, reqs, gen_len: int, until: float) -> dict:
    """transformers + accelerate offload: device_map="auto" with max_memory at the cap."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    gib = cap_bytes / 2**30
    kw = dict(device_map={"": "cpu"}) if c.dry else dict(
        # room beside the resident layers for the offloaded layer accelerate moves in, and activations
        device_map="auto", max_memory={0: f"{max(1.0, gib - MIXTRAL_LAYER_BYTES / 2**30 - 1.5):.1f}GiB",
                                       "cpu": "400GiB"})
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, **kw).eval()
    load = time.perf_counter() - t0
    batch = tok([r.prompt for r in reqs], return_tensors="pt", padding=True)
    dev = "cpu" if c.dry else "cuda"
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**{k: v.to(dev) for k, v in batch.items()}, max_new_tokens=gen_len, do_sample=False,
                             pad_token_id=tok.pad_token_id, max_time=max(1.0, until - time.monotonic()))
    wall = time.perf_counter() - t0
    n = (out.shape[1] - batch["input_ids"].shape[1]) * len(reqs)
    del model
    gc.collect()
    if not c.dry:
        torch.cuda.empty_cache()
    return {"tokens": n, "seconds": round(wall, 2), "tokens_per_s": n / wall, "load_seconds": round(load, 1)}


def gpu_bytes_in_use(c: Check) -> int:
    gc.collect()
    if c.dry:  # what the engines left allocated on their emulated GPUs (0 once every runner is gone)
        return sum(d.memory_allocated() for d in c.devices)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def stage_offload(c: Check, until: float) -> dict:
    from core.io.workloads import build_prompts, target_lengths
    from core.model.families import load_spec
    from core.plan.planner import Workload

    a = c.args
    path = build_big(c.work / "big", a.layers, TINY if c.dry else BIG)
    spec = load_spec(path)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    log(f"offload model: {size / 1e9:.2f} GB on disk, {a.layers} layers")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))  # not Engine.load on the CPU: that reads all of the model
    longest = 48 if c.dry else min(418, spec.max_position - a.gen_len - 1)  # MT-Bench-like: mean 77, up to 418
    lengths = target_lengths(a.requests, mean=16 if c.dry else 77, max_len=longest)
    prompts = build_prompts(tok, lengths)
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=a.gen_len) for i, p in enumerate(prompts)]
    ids = [len(tok(p).input_ids) for p in prompts]
    work = Workload(prompt_len=round(sum(ids) / len(ids)), gen_len=a.gen_len, max_prompt_len=max(ids),
                    num_requests=len(reqs))
    rows = []
    for cap_gb in a.caps:
        # the same regime dry: the cap is the same share of the model as cap GB is of the 10-layer model
        cap = int(cap_gb * 1e9 if not c.dry else size * cap_gb * 1e9 / (10 * MIXTRAL_LAYER_BYTES))
        if not c.dry:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        policy, pred, hw = plan_for_cap(c, spec, cap, work)
        if c.dry and policy.ffn_on != "gpu":  # a tiny model runs fastest on the CPU alone: take a GPU policy
            policy, pred = gpu_policy(spec, hw, work, cap)
        log(f"cap {cap_gb:g} GB: plan N={policy.batch_size} mu={policy.micro_batch_size} r_w="
            f"{policy.gpu_weight_fraction:.3f} pages={policy.pages_per_layer}; predicts {pred.tokens_per_s:.1f} tok/s")
        row = {"cap_gb": cap_gb, "cap_bytes": cap, "model_bytes": size, "policy": policy.to_dict(),
               "prediction": pred.to_dict(), "hardware": hw.to_dict(), "runs": []}
        rows.append(row)
        if policy.ffn_on != "gpu":
            row["note"] = "the planner keeps everything on the CPU at this cap: no GPU run to measure"
            continue
        for name, schedule, pol, prd in variants(c, spec, cap, work, policy, pred, hw):
            if time.monotonic() > until:
                row["runs"].append({"schedule": schedule, "variant": name, "skipped": "deadline"})
                continue
            try:
                r = run_schedule(c, path, spec.num_layers, pol, schedule, reqs, cap, until)
            except Exception as e:  # a schedule that cannot run at this cap is a result, not a crash
                r = {"schedule": schedule, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            r.update(variant=name, policy=pol.to_dict(), prediction=prd.to_dict())
            row["runs"].append(r)
            c.save("offload", {"rows": rows, "partial": True})
            log(f"  {schedule:7} {name:22} mu={pol.micro_batch_size:3} {r.get('tokens_per_s', float('nan')):8.1f} "
                f"tok/s (predicted {prd.tokens_per_s:.1f}; decode step {r.get('decode_step_ms', 0):.0f} ms vs "
                f"{prd.step_seconds * 1e3:.0f}; prefill {r.get('prefill_seconds', 0)} s, first step after "
                f"{r.get('first_step_after_s')} s)  {r.get('error', '')}")
        # our runners are gone: HF's baseline gets the whole cap, as ours did
        row["gpu_bytes_before_hf"] = gpu_bytes_in_use(c)
        if not a.skip_hf and time.monotonic() < until:
            try:
                row["hf_offload"] = hf_offload(c, path, cap, reqs[:a.hf_requests], a.gen_len, until)
            except Exception as e:
                row["hf_offload"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(f"  hf-offload {row['hf_offload'].get('tokens_per_s', float('nan')):8.2f} tok/s")
        c.save("offload", {"rows": rows, "partial": True})
    if not c.dry:
        torch.cuda.set_per_process_memory_fraction(1.0)
    return {"rows": rows, "partial": False}


def stage_pcie(c: Check, until: float) -> dict:
    """Copies through memory page-locked as the runtime does it (cudaHostRegister at the exact size)."""
    from core.runtime.device import resolve_device

    dev = resolve_device("emulated" if c.dry else "cuda")
    n = (64 << 20) if c.dry else (1 << 30)
    host = torch.empty(n, dtype=torch.uint8)
    pinned = dev.pin(host)
    devbuf = dev.empty(n, torch.uint8)
    out = {"pinned": pinned, "bytes": n}
    s = dev.stream("copy")

    def best_gbps(dst, src) -> float:
        best = 0.0
        for _ in range(3):
            a, b = dev.event(timing=True), dev.event(timing=True)
            a.record(s)
            dev.launch(s, lambda: dev.copy(dst, src))
            b.record(s)
            b.synchronize()
            best = max(best, n / (a.elapsed_time(b) / 1e3) / 1e9)
        return best

    out["h2d_gbps"], out["d2h_gbps"] = best_gbps(devbuf, host), best_gbps(host, devbuf)
    if pinned:
        dev.unpin(host)
    # what streaming costs past the pinned budget (core.platform.pinned_budget): the same copy, pageable
    out["h2d_pageable_gbps"] = best_gbps(devbuf, host)
    dev.release_stream(s)
    if c.dry:
        out["note"] = "emulated: a host memcpy, not a link"
    return out


def stage_host(c: Check, until: float) -> dict:
    from core.plan import hrm
    from core.runtime import schedule as sched
    from core.runtime.cuda_executor import CudaExecutor
    from core.runtime.device import resolve_device

    from task_overhead import breakdown, per_op, per_task

    tasks = sched.decode_step("cgopipe", num_layers=4, num_micro_batches=16, pages_per_layer=16)
    dev = resolve_device("emulated" if c.dry else "cuda")
    ex = CudaExecutor(dev)
    try:
        task = per_task(ex, tasks, 3)
    finally:
        ex.close()
    op = per_op("cpu" if c.dry else "cuda")
    return {"task_seconds": task, "op_seconds": op, "planner_task_seconds": hrm.TASK_SECONDS,
            "planner_op_seconds": hrm.OP_SECONDS, "per_call": breakdown(dev)}


def stage_multi(c: Check, until: float) -> dict:
    from multi_gpu import multi_gpu

    return multi_gpu(c.args, c.work, build_big(c.work / "big", c.args.layers, TINY if c.dry else BIG), log)


RUN = {"smoke": stage_smoke, "parity": stage_parity, "offload": stage_offload, "pcie": stage_pcie,
       "host": stage_host, "multi": stage_multi}


# ---- the report -----------------------------------------------------------------------------------------
def table(report: dict) -> str:
    st = report["stages"]
    lines = [f"GPU check — {report['device']} (torch {report['torch']}), {report.get('seconds', 0):.0f} s "
             f"of a {report['deadline_s']:.0f} s deadline"]
    for name in STAGES:
        r = st.get(name)
        if r is None:
            continue
        if "skipped" in r or "error" in r:
            lines.append(f"{name:8} {r.get('skipped') or r.get('error')}")
        elif name == "smoke":
            lines.append(f"smoke    tokens {'equal' if r['equal'] else 'DIFFER'} ({r['seconds']} s)")
        elif name == "parity":
            bad = [f"{x['family']}/{x['schedule']}/{x['paging']}" + (f" ({x['error']})" if x.get("error") else "")
                   for x in r["rows"] if not x["equal"]]
            lines.append(f"parity   {len(r['rows']) - len(bad)}/{len(r['rows'])} equal"
                         + (f"; differ: {', '.join(bad)}" if bad else "") + (" (cut short)" if r["cut_short"] else ""))
        elif name == "pcie":
            lines.append(f"pcie     H2D {r['h2d_gbps']:.1f} GB/s, D2H {r['d2h_gbps']:.1f} GB/s "
                         f"(pinned: {r['pinned']}); H2D from pageable memory {r.get('h2d_pageable_gbps', 0):.1f} GB/s"
                         + (f" — {r['note']}" if "note" in r else ""))
        elif name == "multi":
            from multi_gpu import table_lines

            lines += table_lines(r)
        elif name == "host":
            lines.append(f"host     {r['task_seconds'] * 1e6:.1f} µs/task (planner {r['planner_task_seconds'] * 1e6:.0f}), "
                         f"{r['op_seconds'] * 1e6:.1f} µs/op (planner {r['planner_op_seconds'] * 1e6:.0f})")
            if "per_call" in r:
                lines.append("         per call: " + ", ".join(f"{k} {v * 1e6:.1f} µs" for k, v in r["per_call"].items()))
        elif name == "offload":
            lines.append("offload  cap  schedule    tok/s  predicted  vs-HF  peak/plan   gpu  cpu_attn  h2d   d2h"
                         "   (ms/layer measured:predicted)")
            for row in r["rows"]:
                pred = row["prediction"]
                hf = row.get("hf_offload", {}).get("tokens_per_s")
                for x in row["runs"]:
                    pred = x.get("prediction", row["prediction"])
                    if "tokens_per_s" not in x:
                        lines.append(f"         {row['cap_gb']:4.0f}  {x['schedule']:8}  "
                                     f"{x.get('error') or x.get('skipped')}"[:110])
                        continue
                    ls, pl = x["layer_seconds"], pred["layer_seconds"]
                    per = " ".join(f"{ls[k] * 1e3:.1f}:{pl.get(k, 0) * 1e3:.1f}" for k in RESOURCES)
                    vs = f"{x['tokens_per_s'] / hf:5.1f}x" if hf else "  n/a "
                    lines.append(f"         {row['cap_gb']:4.0f}  {x['schedule']:8} {x['tokens_per_s']:8.1f} "
                                 f"{pred['tokens_per_s']:10.1f} {vs} {x['peak_gpu_bytes'] / max(1, pred['gpu_bytes']):9.2f}  "
                                 f"{per}  {x.get('variant', '')} mu={x.get('policy', {}).get('micro_batch_size', '')}")
                if hf:
                    lines.append(f"         {row['cap_gb']:4.0f}  hf-offload {hf:6.2f} tok/s "
                                 f"(GPU bytes in use before it: {row.get('gpu_bytes_before_hf', 0):,})")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA GPU: run with --dry-run for the emulated one", file=sys.stderr)
        return 2
    c = Check(args)
    os.environ.setdefault("MLIGHT_CACHE_DIR", str(c.work / "cache"))
    # a hung copy or kernel raises DeviceStalled within two minutes instead of eating the whole lease
    os.environ.setdefault("MLIGHT_DEVICE_WAIT_S", "120")
    log(f"GPU check on {c.report['device']}; deadline {args.deadline:.0f} s; results in {args.out}")
    for name in args.stages:
        least, most = STAGES[name]
        left = c.left()
        if left < least:
            c.save(name, {"skipped": f"deadline: {left:.0f} s left, the stage needs {least} s"})
            log(f"{name}: skipped (deadline)")
            continue
        log(f"{name}: starting ({left:.0f} s left)")
        t0 = time.monotonic()
        try:
            result = RUN[name](c, until=time.monotonic() + min(left, most) - 5)
        except Exception as e:  # a stage that breaks is reported; the next stages still run
            result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        result["stage_seconds"] = round(time.monotonic() - t0, 1)
        c.save(name, result)
        log(f"{name}: done in {result['stage_seconds']} s")
    print(table(c.report))
    print(f"\nfull figures: {args.out / 'gpu_check.json'}")
    st = c.report["stages"]
    ok = st.get("smoke", {}).get("equal", True) and all(x["equal"] for x in st.get("parity", {}).get("rows", []))
    return 0 if ok and not any("error" in r for r in st.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
