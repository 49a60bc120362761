"""The GPU check: one run of at most nine minutes, sized for a 15-minute device lease (start-up and copies take
the rest), staged so that a cut-off run still leaves every figure it got. Run it under `timeout`:

    timeout 560 python bench/gpu_check.py --out "$OUT"                      # on the GPU machine (deadline 520 s)
    python bench/gpu_check.py --dry-run --out /tmp/gc                       # anywhere: the emulated GPU

It prints its plan first (stages, seconds each, under RUN_LIMIT). Stages, in order, each later one using what the
earlier ones measured (the link's rates, page-locking's, the host's cost per task and op: kept for this machine
with core.plan.hardware.record_gpu_costs, so `mlight plan` prices with them too); each is skipped (and says so)
when too little of the deadline is left, and each writes gpu_check.json and gpu_check.txt into --out at once:
  smoke         one tiny model through the CUDA executor: tokens equal the CPU engine's
  pcie          host↔device bandwidth through memory page-locked the way the runtime does it, host→device from
                pageable memory, and the rate of page-locking itself (a first run pays it, bench/RESULTS.md)
  host          the executor's host cost per task and per op on this machine (the planner's TASK_SECONDS, OP_SECONDS)
  offload       a Mixtral-shaped bf16 model larger than a memory cap (16 GB = a T4, set with
                torch.cuda.set_per_process_memory_fraction, reset in a `finally`): the planner's policy, loaded and
                page-locked once per cap; its variants (measured host costs, larger micro-batches, S4, S3) run on
                that one engine; those that do not divide N are listed, not run
  many-experts  a 4-layer Qwen3-30B-A3B-shaped model (E = 128, top-8), int4 and bf16, under the same share of a cap
  baseline      HF accelerate offload (device_map="auto") on the same model and the same N as offload's plan,
                retried once with less max_memory when it runs out; our best run at that cap over it
  parity        every family × schedule (CGOPipe, S3, S4) × paging on the GPU against the CPU engine
  multi         (with --multi-gpu; not in the nine minutes) tensor-parallel scaling (bench/multi_gpu.py)
Per run: tok/s, predicted tok/s, the fraction of the PCIe bound of its own policy, launches / event waits / host
syncs per layer of a step (torch.profiler on CUDA; the emulated device counts its own calls), page-locking seconds.
A stall watchdog dumps every thread's stack after STALL_S seconds without progress, and every wait on the device
has the same bound (MLIGHT_DEVICE_WAIT_S). `--dry-run` runs the same code on the emulated device
(core.runtime.device_emulated) with tiny models and caps scaled to the model, so CI proves the script end to end;
its figures are not speeds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
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
from core.telemetry import RESOURCES, Busy, StepDone  # noqa: E402

BIG = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, experts=8, top_k=2, vocab=32000)
TINY = dict(hidden=256, intermediate=512, heads=8, kv_heads=2, experts=8, top_k=2, vocab=512)
# Qwen3-30B-A3B's config.json: hidden 2048, moe_intermediate 768, 32 heads of 128, 4 K/V heads, 128 experts, top-8
QWEN3 = dict(hidden=2048, intermediate=768, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, vocab=151936)
# dry: 32 experts — the emulated device runs quantized experts one by one in Python (≈ 30 ms each at int4)
QWEN3_TINY = dict(hidden=64, intermediate=64, heads=4, kv_heads=2, head_dim=16, experts=32, top_k=8, vocab=512)
MIXTRAL_LAYER_BYTES = 2 * (3 * 8 * 4096 * 14336 + 4096 * (4096 + 2 * 1024 + 4096) + 8 * 4096)  # bf16
PROMPTS = ["Hi", "Compose an engaging travel blog post about Hawaii.", "x y z", "What is 2+2? Explain.",
           "Draft an email to a colleague.", "Tell me a story about a cat and a dog"]
# seconds a stage needs at least to be worth starting, and the most the real run gives it (its plan); in this order
STAGES = {"smoke": (20, 40), "pcie": (5, 20), "host": (5, 15), "offload": (90, 210), "many-experts": (30, 75),
          "baseline": (30, 90), "parity": (20, 60), "multi": (60, 300)}
RUN_LIMIT = 540  # one run, start-up of the process included: nine of a lease's fifteen minutes
DEADLINE = 520
STALL_S = 90  # no progress for this long: every thread's stack is dumped, and a device wait raises


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="the emulated GPU and tiny models (CI)")
    p.add_argument("--out", type=Path, default=None, help="folder for gpu_check.json/.txt (default $OUT or .)")
    p.add_argument("--deadline", type=float, default=DEADLINE,
                   help=f"seconds for the whole check (default {DEADLINE}, under the {RUN_LIMIT} s of one run)")
    p.add_argument("--stages", default=None, help=f"comma-separated subset of {', '.join(STAGES)} (default: all "
                   "but multi, which --multi-gpu adds)")
    p.add_argument("--layers", type=int, default=None, help="layers of the offload model (default 10 ≈ 29 GB; 4 dry)")
    p.add_argument("--caps", default="16", help="GPU memory caps in GB (default 16: a T4)")
    p.add_argument("--requests", type=int, default=None, help="requests per offload run (default 128; 8 dry)")
    p.add_argument("--gen-len", type=int, default=None, help="tokens per request (default 16; 4 dry)")
    p.add_argument("--skip-hf", action="store_true", help="leave out the baseline stage")
    p.add_argument("--workdir", type=Path, default=None, help="where models are built (default: a temp dir)")
    p.add_argument("--multi-gpu", action="store_true",
                   help="also the multi stage: tensor-parallel scaling over this machine's GPUs (bench/multi_gpu.py)")
    a = p.parse_args(argv)
    a.layers = a.layers or (4 if a.dry_run else 10)
    a.requests = a.requests or (8 if a.dry_run else 128)
    a.gen_len = a.gen_len or (4 if a.dry_run else 16)
    a.caps = [float(c) for c in a.caps.split(",")]
    a.stages = [s.strip() for s in a.stages.split(",") if s.strip()] if a.stages else [
        s for s in STAGES if (s != "multi" or a.multi_gpu) and (s != "baseline" or not a.skip_hf)]
    unknown = set(a.stages) - set(STAGES)
    if unknown:
        p.error(f"unknown stage(s) {', '.join(sorted(unknown))}; choose from {', '.join(STAGES)}")
    a.stages = [s for s in STAGES if s in a.stages]  # always in the order that feeds later stages
    a.out = a.out or Path(os.environ.get("OUT", "."))
    return a


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
    faulthandler.dump_traceback_later(STALL_S, exit=False)  # progress: the stall watchdog starts again


def real_run_plan(stages: list[str]) -> list[tuple[str, int]]:
    """(stage, seconds) of a real run of these stages: each stage's share of the run (STAGES)."""
    return [(s, STAGES[s][1]) for s in stages]


def plan_text(stages: list[str]) -> str:
    plan = real_run_plan([s for s in stages if s != "multi"])
    total = sum(sec for _, sec in plan)
    return (f"plan of a real run: {' → '.join(f'{s} {sec} s' for s, sec in plan)} = {total} s "
            f"of {RUN_LIMIT} s" + (" (multi on top)" if "multi" in stages else ""))


class Check:
    """Shared state of the run: the deadline, the device factory, what the stages measured, and the report
    written after each stage."""

    def __init__(self, args):
        self.args, self.dry = args, args.dry_run
        self.start = time.monotonic()
        self.deadline = self.start + args.deadline
        self.work = args.workdir or Path(tempfile.mkdtemp(prefix="mlight-gpu-check-"))
        self.devices: list = []  # dry: every emulated GPU made, to read what is still allocated on them
        self.base = None  # this machine as detected / probed, before the stages' measurements
        self.user_cache: str | None = None  # MLIGHT_CACHE_DIR as the user had it (None: the default folder)
        self.op_seconds: float | None = None  # host seconds a GPU-stream op costs, from a launch-bound run here
        self.report = {"device": "emulated GPU (dry run)" if self.dry else torch.cuda.get_device_name(0),
                       "torch": torch.__version__, "dry_run": self.dry, "deadline_s": args.deadline,
                       "plan": dict(real_run_plan(args.stages)), "args": {k: str(v) for k, v in vars(args).items()},
                       "stages": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def device(self, cap_bytes: int | None = None):
        """A fresh device for one engine: the emulated GPU (its memory = the cap), or CUDA."""
        if self.dry:
            from core.runtime.device_emulated import EmulatedCuda

            dev = EmulatedCuda(cap_bytes or (1 << 34))
            self.devices.append(dev)
            return dev
        from core.runtime.device import resolve_device

        return resolve_device("cuda")

    def machine(self, cap_bytes: int):
        """This machine with what the stages measured, the GPU capped at `cap_bytes` (dry: the CPU plays a GPU
        ten times its speed behind a link as fast as its memory)."""
        from core.plan import hardware

        if self.base is None:
            self.base = hardware.detect() if self.dry else hardware.resolve("local")
        hw, st = self.base, self.report["stages"]
        if self.dry:
            hw = dataclasses.replace(hw, gpu_name="emulated GPU", gpu_count=1, gpu_mem_bytes=cap_bytes,
                                     gpu_flops=10 * hw.cpu_flops, gpu_bw=10 * hw.cpu_bw, h2d_bw=hw.cpu_bw,
                                     d2h_bw=hw.cpu_bw, gpu_capability=(8, 9))
        elif st.get("pcie", {}).get("h2d_gbps"):
            pcie = st["pcie"]
            hw = dataclasses.replace(hw, h2d_bw=pcie["h2d_gbps"] * 1e9, d2h_bw=pcie["d2h_gbps"] * 1e9,
                                     measured=tuple(sorted(set(hw.measured) | {"h2d_bw", "d2h_bw"})))
        host, pin = st.get("host", {}), st.get("pcie", {}).get("pin_gbps")
        if host.get("task_seconds"):
            hw = dataclasses.replace(hw, host_task_seconds=host["task_seconds"])
        if self.op_seconds:
            hw = dataclasses.replace(hw, host_op_seconds=self.op_seconds)
        if pin:
            hw = dataclasses.replace(hw, pin_bw=pin * 1e9)
        return dataclasses.replace(hw, gpu_mem_bytes=cap_bytes, gpu_mem_free_bytes=None,
                                   gpu_count=min(1, hw.gpu_count))  # the check runs one GPU

    def save(self, name: str, result: dict) -> None:
        self.report["stages"][name] = result
        self.report["seconds"] = round(time.monotonic() - self.start, 1)
        out = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=1, default=str), encoding="utf-8")
        tmp.replace(out / "gpu_check.json")  # a reader never sees half a file
        (out / "gpu_check.txt").write_text(table(self.report) + "\n", encoding="utf-8")


# ---- small models and the CPU reference ---------------------------------------------------------------------
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
    cut = time.monotonic() > until
    return {"equal": agree(got, want, cut), "cut_short": cut, "requests": len(got),
            "seconds": round(time.monotonic() - t0, 1)}


def agree(got: dict, want: dict, cut_short: bool) -> bool:
    """The device's tokens are the reference's: all of them, or where the stage's time ran out mid-run, a
    prefix of each request's (a slow machine's short run is not a wrong one)."""
    if not cut_short:
        return got == want
    return got.keys() <= want.keys() and all(want[i][:len(t)] == t for i, t in got.items())


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


# ---- large models, written shard by shard -------------------------------------------------------------------
def _bank_rand(seed: int):
    """rand(*shape): slices of one random bf16 bank at random offsets — realistic magnitudes, built in seconds."""
    g = torch.Generator().manual_seed(seed)
    bank = (torch.randn(1 << 24, generator=g) * 0.02).to(torch.bfloat16)

    def rand(*shape):
        n = 1
        for s in shape:
            n *= s
        out = torch.empty(n, dtype=torch.bfloat16)
        done = 0
        while done < n:
            take = min(n - done, bank.numel() // 2)
            off = int(torch.randint(0, bank.numel() - take + 1, (1,), generator=g))
            out[done:done + take] = bank[off:off + take]
            done += take
        return out.view(*shape)

    return rand


def build_model(path: Path, family: str, layers: int, dims: dict, seed: int = 0) -> Path:
    """A Mixtral- or Qwen3-MoE-shaped bf16 checkpoint, one shard a layer, per-expert tensors as on the hub."""
    from safetensors.torch import save_file

    from core.model.demo import build_tokenizer

    if (path / "model.safetensors.index.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    D, I, H, Hkv, E, V = (dims[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "experts", "vocab"))
    hd = dims.get("head_dim", D // H)
    build_tokenizer(path, vocab_size=min(V, 4096))
    common = dict(vocab_size=V, hidden_size=D, num_hidden_layers=layers, num_attention_heads=H,
                  num_key_value_heads=Hkv, num_experts_per_tok=dims["top_k"], max_position_embeddings=4096,
                  bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    if family == "mixtral":
        from transformers import MixtralConfig

        cfg = MixtralConfig(intermediate_size=I, num_local_experts=E, **common)
        arch, moe, names = "MixtralForCausalLM", "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        from transformers import Qwen3MoeConfig

        cfg = Qwen3MoeConfig(intermediate_size=4 * I, moe_intermediate_size=I, num_experts=E, head_dim=hd,
                             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common)
        arch, moe, names = "Qwen3MoeForCausalLM", "mlp.", ("gate_proj", "up_proj", "down_proj")
    cfg.dtype = "bfloat16"
    cfg.architectures = [arch]
    cfg.save_pretrained(str(path))
    rand, ones = _bank_rand(seed), (lambda n: torch.ones(n, dtype=torch.bfloat16))
    weight_map = {}

    def shard(name: str, tensors: dict):
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    shard("model-globals.safetensors", {"model.embed_tokens.weight": rand(V, D), "lm_head.weight": rand(V, D),
                                        "model.norm.weight": ones(D)})
    gate, up, down = names
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": ones(D), p + "post_attention_layernorm.weight": ones(D),
             p + "self_attn.q_proj.weight": rand(H * hd, D), p + "self_attn.k_proj.weight": rand(Hkv * hd, D),
             p + "self_attn.v_proj.weight": rand(Hkv * hd, D), p + "self_attn.o_proj.weight": rand(D, H * hd),
             p + moe + "gate.weight": rand(E, D) * 10}
        if family != "mixtral":
            t.update({p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd)})
        for e in range(E):
            q = f"{p}{moe}experts.{e}."
            t.update({q + f"{gate}.weight": rand(I, D), q + f"{up}.weight": rand(I, D),
                      q + f"{down}.weight": rand(D, I)})
        shard(f"model-layer-{i:03d}.safetensors", t)
        log(f"built {family} layer {i + 1}/{layers}")
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def build_big(path: Path, layers: int, dims: dict, seed: int = 0) -> Path:
    """The Mixtral-shaped model of the offload stage (bench/multi_gpu.py builds the same)."""
    return build_model(path, "mixtral", layers, dims, seed)


def workload_for(c: Check, path: Path, n: int, gen_len: int | None = None):
    """MT-Bench-like prompts for the model's tokenizer (mean 77 tokens, up to 418; dry: mean 16) and the
    planner's Workload of them."""
    from transformers import AutoTokenizer

    from core.io.workloads import build_prompts, target_lengths
    from core.plan.planner import Workload

    a = c.args
    tok = AutoTokenizer.from_pretrained(str(path))  # not Engine.load on the CPU: that reads all of the model
    lengths = target_lengths(n, mean=16 if c.dry else 77, max_len=48 if c.dry else 418)
    prompts = build_prompts(tok, lengths)
    gen_len = gen_len or a.gen_len
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=gen_len) for i, p in enumerate(prompts)]
    ids = [len(tok(p).input_ids) for p in prompts]
    return reqs, Workload(prompt_len=round(sum(ids) / len(ids)), gen_len=gen_len, max_prompt_len=max(ids),
                          num_requests=len(reqs))


def scaled_cap(c: Check, cap_gb: float, model_bytes: int) -> int:
    """Dry: the cap the same share of this model as cap GB is of the 10-layer Mixtral (the same regime)."""
    return int(cap_gb * 1e9 if not c.dry else model_bytes * cap_gb * 1e9 / (10 * MIXTRAL_LAYER_BYTES))


def plan_for_cap(c: Check, spec, cap_bytes: int, work):
    """The planner's policy and prediction for this model with the GPU capped at `cap_bytes`, priced with what
    the earlier stages measured (Check.machine)."""
    from core.plan.planner import Budget, plan

    hw = c.machine(cap_bytes)
    budget = Budget(gpu_bytes=cap_bytes, cpu_bytes=int(0.8 * hw.cpu_mem_bytes))
    policy, pred = plan(spec, hw, work, budget, ranks=1)  # one process on one GPU
    if c.dry and policy.ffn_on != "gpu":  # a tiny model runs fastest on the CPU alone: take a GPU policy
        policy, pred = gpu_policy(spec, hw, work, cap_bytes)
    return policy, pred, hw


def gpu_policy(spec, hw, work, cap: int):
    """The most resident experts that fit, with the FFN on the GPU (dry runs only)."""
    from core.plan.planner import Budget, predict, validate
    from core.plan.policy import Policy

    n = min(8, work.num_requests)
    for r_w in (0.5, 0.25, 0.0):
        policy = Policy(n, max(1, n // 2), max(1, n // 2), "cpu", "gpu", r_w, 0.0, 2)
        if not validate(policy, spec, hw, work, Budget(cap, int(0.8 * hw.cpu_mem_bytes))) or r_w == 0.0:
            return policy, predict(policy, spec, hw, work)


def variants(spec, cap: int, work, policy, pred, hw) -> tuple[list, list]:
    """([(name, schedule, policy, prediction)] to run on one engine at one cap, [variants not run, and why]): the
    planner's policy (priced with the host's measured costs); it at 4 and 16 times its micro-batch (what the host
    bound trades against); S4 and S3 at it."""
    from core.plan.planner import Budget, predict, validate

    out, not_run = [("planner", "cgopipe", policy, pred)], []
    budget = Budget(gpu_bytes=cap, cpu_bytes=int(0.8 * hw.cpu_mem_bytes))
    N = policy.batch_size
    for mu in (4 * policy.micro_batch_size, 16 * policy.micro_batch_size):
        name = f"mu={mu}"
        if mu > N or N % mu:
            why = f"μ = {mu} is over N = {N}" if mu > N else f"μ = {mu} does not divide N = {N}"
            not_run.append({"variant": name, "why": why})
            continue
        eb = max(mu, policy.expert_batch_size)
        if N % eb:
            not_run.append({"variant": name, "why": f"its expert batch {eb} does not divide N = {N}"})
            continue
        # a larger micro-batch's prefill activations take room: fewer resident experts where needed
        shares = (policy.gpu_weight_fraction, policy.gpu_weight_fraction / 2, 0.0)
        fits = [p for rw in shares
                for p in [dataclasses.replace(policy, micro_batch_size=mu, expert_batch_size=eb,
                                              gpu_weight_fraction=rw)]
                if not validate(p, spec, hw, work, budget)]
        if fits:
            out.append((name, "cgopipe", fits[0], predict(fits[0], spec, hw, work)))
        else:
            not_run.append({"variant": name, "why": "does not fit the cap at any resident share"})
    return out + [("at the policy above", "s4", policy, pred), ("at the policy above", "s3", policy, pred)], not_run


# ---- one engine per cap, its runs, what they cost ---------------------------------------------------------
class PinClock:
    """Seconds and bytes the device spent page-locking host memory (wraps the device's `pin`)."""

    def __init__(self, dev):
        self.seconds, self.bytes, real = 0.0, 0, dev.pin

        def pin(t):
            t0 = time.perf_counter()
            ok = real(t)
            self.seconds += time.perf_counter() - t0
            self.bytes += t.numel() * t.element_size() if ok else 0
            return ok

        dev.pin = pin


# CUDA runtime calls torch.profiler names: kernel launches (and copies), event waits, host syncs
_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaMemcpyAsync", "cudaMemsetAsync")
_WAITS = ("cudaStreamWaitEvent",)
_SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


# the decode steps torch.profiler records on a GPU (after the prefill and one warm-up step): enough to count a
# layer's calls, few enough that reading the trace back takes seconds, not minutes
PROFILED_STEPS = 2


@contextlib.contextmanager
def counting(c: Check, on: bool = True):
    """Launches, event waits and host syncs while the block runs, and over how many steps: on a GPU,
    torch.profiler's CUDA runtime calls over PROFILED_STEPS decode steps (call counts["step"]() after each step);
    on the emulated device its own calls over the whole run (a task's launch onto a stream, a stream's wait on an
    event, a host wait or synchronize) — per task, not per torch op (bench/launch_budget.py counts torch ops a
    layer there). Host waits on a GPU poll events (cudaEventQuery), which are not counted as syncs."""
    counts = {"launches": 0, "waits": 0, "syncs": 0, "source": None, "steps": None, "step": lambda: None}
    if not on:
        yield counts
        return
    if not c.dry:
        from torch.profiler import ProfilerActivity, profile, schedule

        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                       schedule=schedule(wait=1, warmup=1, active=PROFILED_STEPS, repeat=1))
        taken = []
        counts["step"] = lambda: taken.append(1) or prof.step()
        prof.start()
        try:
            yield counts
        finally:
            prof.stop()
        if len(taken) < 2 + PROFILED_STEPS:
            counts["source"] = f"torch.profiler: the run had {len(taken)} steps, too few to profile"
            return
        names = {e.key: e.count for e in prof.key_averages()}
        for key, group in (("launches", _LAUNCHES), ("waits", _WAITS), ("syncs", _SYNCS)):
            counts[key] = sum(names.get(n, 0) for n in group)
        counts.update(source=f"torch.profiler (CUDA runtime calls over {PROFILED_STEPS} decode steps)",
                      steps=PROFILED_STEPS)
        return
    from core.runtime import device_emulated as emu

    patched = ((emu.EmulatedCuda, "launch"), (emu._Stream, "wait_event"), (emu.EmulatedCuda, "host_wait"),
               (emu.EmulatedCuda, "synchronize"))
    saved = {(cls, name): getattr(cls, name) for cls, name in patched}

    def counted(fn, key):
        def wrapper(*a, **kw):
            counts[key] += 1
            return fn(*a, **kw)
        return wrapper

    keys = {"launch": "launches", "wait_event": "waits", "host_wait": "syncs", "synchronize": "syncs"}
    try:
        for (cls, name), fn in saved.items():
            setattr(cls, name, counted(fn, keys[name]))
        yield counts
    finally:
        for (cls, name), fn in saved.items():
            setattr(cls, name, fn)
    counts["source"] = "emulated device calls (tasks launched, stream waits, host waits)"


def pcie_bound(spec, policy, h2d_bw: float) -> float:
    """Decode tokens/s the link allows this policy: each step streams every layer's non-resident experts."""
    streamed = (1 - policy.gpu_weight_fraction) * spec.layer_expert_bytes * spec.moe_layers
    return policy.batch_size / (streamed / h2d_bw) if streamed else float("inf")


def run_variant(c: Check, engine, spec, pol, prd, schedule: str, reqs, until: float, pins: PinClock,
                h2d_bw: float, profile: bool) -> dict:
    """One generate call of `reqs` on the loaded engine under `pol` and `schedule`."""
    engine.apply_policy(pol)
    engine.configure(schedule=schedule)
    # the last run's runner holds its device buffers until a collection finds its reference cycle (the run itself
    # freezes the collector): without one the next run on this engine found its cap full
    gc.collect()
    engine.dev.reset_peak_memory_stats()
    events: list[StepDone] = []
    first: list[float] = []

    counts: dict = {}

    def on_event(e):
        if isinstance(e, StepDone):
            events.append(e)
            counts.get("step", lambda: None)()
            if not first:
                first.append(time.perf_counter())

    pin0 = pins.seconds, pins.bytes
    t0 = time.perf_counter()
    with counting(c, profile) as counts:
        results = list(engine.generate(reqs, on_event=on_event, should_stop=lambda: time.monotonic() > until))
    wall = time.perf_counter() - t0
    layers = spec.num_layers
    decode = [e for e in events if e.kind == "decode"]
    dsec = sum(e.seconds for e in decode) or 1e-9
    tokens_out = sum(r.output_tokens for r in results)
    decode_tps = sum(e.tokens for e in decode) / dsec
    bound = pcie_bound(spec, pol, h2d_bw)
    steps = max(1, counts.get("steps") or len(events))
    return {"schedule": schedule, "requests_done": len(results), "tokens": tokens_out, "seconds": round(wall, 2),
            "tokens_per_s": tokens_out / wall, "decode_tokens_per_s": decode_tps,
            "predicted_tokens_per_s": prd.tokens_per_s, "predicted_decode_tokens_per_s": prd.decode_tokens_per_s,
            "pcie_bound_tokens_per_s": bound, "fraction_of_pcie_bound": decode_tps / bound,
            "pin_seconds": round(pins.seconds - pin0[0], 3), "pin_bytes": pins.bytes - pin0[1],
            "first_step_after_s": round(first[0] - t0, 2) if first else None,
            "prefill_seconds": round(sum(e.seconds for e in events if e.kind != "decode"), 2),
            "decode_seconds": round(dsec, 2), "decode_steps": len(decode),
            "decode_step_ms": 1e3 * dsec / max(1, len(decode)),
            "layer_seconds": {r: sum(e.busy.get(r, 0.0) for e in decode) / max(1, len(decode)) / layers
                              for r in RESOURCES},
            **({f"{k}_per_layer_step": counts[k] / (steps * layers) for k in ("launches", "waits", "syncs")}
               | {"counted_by": counts["source"]} if profile else {}),
            "peak_gpu_bytes": engine.dev.max_memory_allocated(), "cut_short": time.monotonic() > until}


@contextlib.contextmanager
def capped(c: Check, cap: int):
    """The GPU capped at `cap` bytes for this process (dry: the emulated device is made that size); the memory
    fraction reset however the block ends."""
    if c.dry:
        yield
        return
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def run_cap(c: Check, path: Path, spec, cap: int, runs: list, reqs, until: float, quantize: str | None = None,
            label: str = "") -> dict:
    """Load (and page-lock) the model once at this cap and run `runs` [(name, schedule, policy, prediction)] on
    it, one after another; the engine is closed (its memory given back) before this returns."""
    out = {"runs": [], "load_seconds": None}
    h2d = (c.report["stages"].get("pcie", {}).get("h2d_gbps") or 0) * 1e9 or c.machine(cap).h2d_bw
    with capped(c, cap):
        dev = c.device(cap)
        pins = PinClock(dev)
        t0 = time.perf_counter()
        engine = Engine.load(path, device=dev, executor="cuda", policy=runs[0][2], schedule=runs[0][1],
                             quantize=quantize)
        out["load_seconds"] = round(time.perf_counter() - t0, 2)
        engine.eos_ids = set()
        try:
            for i, (name, schedule, pol, prd) in enumerate(runs):
                if time.monotonic() > until:
                    out["runs"].append({"schedule": schedule, "variant": name, "skipped": "deadline"})
                    continue
                try:
                    r = run_variant(c, engine, spec, pol, prd, schedule, reqs, until, pins, h2d, profile=i == 0)
                except Exception as e:  # a variant that cannot run at this cap is a result, not a crash
                    r = {"schedule": schedule, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                r.update(variant=name, policy=pol.to_dict(), prediction=prd.to_dict())
                out["runs"].append(r)
                log(f"  {label}{schedule:7} {name:20} mu={pol.micro_batch_size:3} "
                    f"{r.get('tokens_per_s', float('nan')):8.1f} tok/s (predicted {prd.tokens_per_s:.1f}; "
                    f"{r.get('fraction_of_pcie_bound', float('nan')):.0%} of the PCIe bound; decode step "
                    f"{r.get('decode_step_ms', 0):.0f} ms vs {prd.step_seconds * 1e3:.0f}; pinning "
                    f"{r.get('pin_seconds', 0)} s) {r.get('error', '')}")
        finally:
            engine.close()
            del engine
            gc.collect()
    out["pin_seconds"], out["pin_bytes"] = round(pins.seconds, 3), pins.bytes
    return out


def op_seconds_from_run(run: dict, pred) -> float | None:
    """Host seconds a GPU-stream op costs, from a profiled run that was launch-bound (its GPU stream busy over
    twice what the GPU's own work takes by the model): the stream's busy time a layer over its calls a layer."""
    launches = run.get("launches_per_layer_step", 0) + run.get("waits_per_layer_step", 0)
    busy = Busy(run.get("layer_seconds", {})).get("compute", 0.0)  # Busy: an older report keys it "gpu"
    if not launches or busy <= 2 * Busy(pred.layer_seconds).get("compute", 0.0):
        return None
    return busy / launches


def stage_offload(c: Check, until: float) -> dict:
    from core.model.families import load_spec

    a = c.args
    path = build_big(c.work / "big", a.layers, TINY if c.dry else BIG)
    spec = load_spec(path)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    log(f"offload model: {size / 1e9:.2f} GB on disk, {a.layers} layers")
    reqs, work = workload_for(c, path, a.requests)
    rows = []
    for cap_gb in a.caps:
        cap = scaled_cap(c, cap_gb, size)
        policy, pred, hw = plan_for_cap(c, spec, cap, work)
        log(f"cap {cap_gb:g} GB: plan N={policy.batch_size} mu={policy.micro_batch_size} r_w="
            f"{policy.gpu_weight_fraction:.3f} pages={policy.pages_per_layer}; predicts {pred.tokens_per_s:.1f} tok/s")
        row = {"cap_gb": cap_gb, "cap_bytes": cap, "model_bytes": size, "policy": policy.to_dict(),
               "prediction": pred.to_dict(), "hardware": hw.to_dict(), "runs": []}
        rows.append(row)
        if policy.ffn_on != "gpu":
            row["note"] = "the planner keeps everything on the CPU at this cap: no GPU run to measure"
            continue
        runs, row["not_run"] = variants(spec, cap, work, policy, pred, hw)
        for x in row["not_run"]:
            log(f"  not run: {x['variant']}: {x['why']}")
        row.update(run_cap(c, path, spec, cap, runs, reqs, until))
        op = op_seconds_from_run(row["runs"][0], pred)
        if op and not c.dry:
            row["op_seconds_from_run"], c.op_seconds = op, op
            row["kept_in"] = keep_costs(c, host_op_seconds=op)
        c.save("offload", {"rows": rows, "partial": True})
    c.offload = (path, reqs, rows)
    return {"rows": rows, "partial": False}


EXPERT_SHARE = 0.25  # many-experts: the cap holds this share of the experts beside the smallest GPU plan


def stage_many_experts(c: Check, until: float) -> dict:
    """The 2026 models a 16 GB card runs: 128 small experts, top-8, int4 and bf16, most of them streamed (a cap
    with room for EXPERT_SHARE of them beside the smallest GPU plan)."""
    from core.model.families import load_spec
    from core.model.quant.formats import parse_choice, quantized_spec
    from core.plan.planner import GPU_USABLE, memory_use
    from core.plan.policy import Policy

    path = build_model(c.work / "qwen3", "qwen3", 4, QWEN3_TINY if c.dry else QWEN3)
    base = load_spec(path)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    # dry: a few requests, two tokens (see QWEN3_TINY)
    reqs, work = workload_for(c, path, 4, 2) if c.dry else workload_for(c, path, c.args.requests)
    rows = []
    for fmt in ("int4", "bf16"):
        if time.monotonic() > until:
            rows.append({"format": fmt, "skipped": "deadline"})
            continue
        spec = quantized_spec(base, parse_choice(fmt if fmt != "bf16" else None))
        model_bytes = spec.total_bytes
        # room for the smallest GPU plan (non-expert weights, the double buffer) and a quarter of the experts:
        # most of them stream, in either format
        smallest = Policy(1, 1, 1, "cpu", "gpu", 0.0, 0.0, 1)
        need = sum(memory_use(spec, smallest, work)[0].values())
        cap = int((need + EXPERT_SHARE * spec.total_expert_bytes) / GPU_USABLE)
        policy, pred, hw = plan_for_cap(c, spec, cap, work)
        row = {"format": fmt, "cap_bytes": cap, "model_bytes": model_bytes, "disk_bytes": size,
               "policy": policy.to_dict(), "prediction": pred.to_dict()}
        log(f"many-experts {fmt}: cap {cap / 1e9:.2f} GB, plan N={policy.batch_size} mu={policy.micro_batch_size} "
            f"r_w={policy.gpu_weight_fraction:.3f}; predicts {pred.tokens_per_s:.1f} tok/s")
        rows.append(row)
        if policy.ffn_on != "gpu":
            row["note"] = "the planner keeps everything on the CPU at this cap"
            continue
        try:
            row.update(run_cap(c, path, spec, cap, [("planner", "cgopipe", policy, pred)], reqs, until,
                               quantize=None if fmt == "bf16" else fmt, label=f"{fmt} "))
        except Exception as e:  # noqa: BLE001 - one format failing is a row of the result
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        c.save("many-experts", {"rows": rows, "partial": True})
    return {"rows": rows, "partial": False}


# ---- the baseline: HF accelerate on the same N -----------------------------------------------------------
def hf_offload(c: Check, path: Path, cap_bytes: int, reqs, gen_len: int, until: float, max_memory_gib: float) -> dict:
    """transformers + accelerate offload: device_map="auto" with `max_memory_gib` on the GPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    kw = dict(device_map={"": "cpu"}) if c.dry else dict(
        device_map="auto", max_memory={0: f"{max_memory_gib:.1f}GiB", "cpu": "400GiB"})
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, **kw).eval()
    load = time.perf_counter() - t0
    batch = tok([r.prompt for r in reqs], return_tensors="pt", padding=True)
    dev = "cpu" if c.dry else "cuda"
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            out = model.generate(**{k: v.to(dev) for k, v in batch.items()}, max_new_tokens=gen_len,
                                 do_sample=False, pad_token_id=tok.pad_token_id,
                                 max_time=max(1.0, until - time.monotonic()))
        wall = time.perf_counter() - t0
        n = (out.shape[1] - batch["input_ids"].shape[1]) * len(reqs)
    finally:
        del model
        gc.collect()
        if not c.dry:
            torch.cuda.empty_cache()
    return {"requests": len(reqs), "tokens": n, "seconds": round(wall, 2), "tokens_per_s": n / wall,
            "load_seconds": round(load, 1), "max_memory_gib": round(max_memory_gib, 1)}


def gpu_bytes_in_use(c: Check) -> int:
    gc.collect()
    if c.dry:  # what the engines left allocated on their emulated GPUs (0 once every runner is gone)
        return sum(d.memory_allocated() for d in c.devices)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def stage_baseline(c: Check, until: float) -> dict:
    """HF accelerate on the offload stage's model and its plan's N at the first cap (our runners are gone: it
    gets the whole cap, as ours did); once more with 2 GiB less on the GPU if it runs out of memory."""
    if not getattr(c, "offload", None):
        return {"skipped": "no offload stage ran: nothing to compare with"}
    path, reqs, rows = c.offload
    row = rows[0]
    N = min(row["policy"]["batch_size"], len(reqs))
    ours = max((r.get("tokens_per_s", 0) for r in row.get("runs", [])), default=0)
    out = {"cap_gb": row["cap_gb"], "N": N, "gpu_bytes_before": gpu_bytes_in_use(c), "ours_tokens_per_s": ours}
    gib = row["cap_bytes"] / 2**30 - MIXTRAL_LAYER_BYTES / 2**30 - 1.5  # room for the layer accelerate moves in
    with capped(c, row["cap_bytes"]):
        for attempt in (gib, gib - 2):
            try:
                out.update(hf_offload(c, path, row["cap_bytes"], reqs[:N], c.args.gen_len, until, max(1.0, attempt)))
                break
            except torch.cuda.OutOfMemoryError as e:
                out.setdefault("out_of_memory", []).append(f"max_memory {attempt:.1f} GiB: {str(e)[:200]}")
                gc.collect()
                if not c.dry:
                    torch.cuda.empty_cache()
    if out.get("tokens_per_s") and ours:
        out["ours_over_hf"] = ours / out["tokens_per_s"]
    log(f"  hf-offload N={N}: {out.get('tokens_per_s', float('nan')):.2f} tok/s; ours {ours:.1f} "
        f"({out.get('ours_over_hf', float('nan')):.1f}x)")
    return out


def stage_pcie(c: Check, until: float) -> dict:
    """Copies through memory page-locked as the runtime does it (cudaHostRegister at the exact size), and the time
    page-locking itself takes (a first run pays it for every streamed byte)."""
    from core.runtime.device import resolve_device

    dev = resolve_device("emulated" if c.dry else "cuda")
    n = (64 << 20) if c.dry else (1 << 30)
    host = torch.empty(n, dtype=torch.uint8)
    host[::4096] = 1  # the pages exist before page-locking is timed, as a loaded model's do
    t0 = time.perf_counter()
    pinned = dev.pin(host)
    pin_s = time.perf_counter() - t0
    devbuf = dev.empty(n, torch.uint8)
    out = {"pinned": pinned, "bytes": n, "pin_gbps": n / pin_s / 1e9 if pinned else None}
    s = dev.stream("copy")

    def best_gbps(dst, src) -> float:
        best = 0.0
        for _ in range(3):
            a, b = dev.event(timing=True), dev.event(timing=True)
            a.record(s)
            dev.launch(s, lambda: dev.copy(dst, src))
            b.record(s)
            dev.host_wait(b, what="the PCIe stage's copy")  # bounded: MLIGHT_DEVICE_WAIT_S
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
    elif out["pin_gbps"]:
        out["kept_in"] = keep_costs(c, pin_bw=out["pin_gbps"] * 1e9)
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
    # one tiny op from Python (7.4 µs on the H200) is not a layer's op under the executor's threads (22-29 µs there):
    # only the task cost is kept here; an op's comes from the offload stage's profiled run (op_seconds_from_run)
    kept = keep_costs(c, host_task_seconds=task) if not c.dry else None
    return {"task_seconds": task, "op_seconds": op, "planner_task_seconds": hrm.TASK_SECONDS,
            "planner_op_seconds": hrm.OP_SECONDS, "per_call": breakdown(dev), "kept_in": kept}


def keep_costs(c: Check, **values: float) -> list[str]:
    """Record measured GPU-path costs for this machine (core.plan.hardware.record_gpu_costs) in the run's cache and
    in the user's (the one `mlight plan` reads; this run points MLIGHT_CACHE_DIR at its work folder)."""
    from core.plan.hardware import record_gpu_costs

    c.machine(1 << 30)  # c.base: the machine as detected, whose key the planner looks it up by
    paths = [str(record_gpu_costs(c.base, **values))]
    run_cache = os.environ.get("MLIGHT_CACHE_DIR")
    try:
        if c.user_cache is None:
            os.environ.pop("MLIGHT_CACHE_DIR", None)
        else:
            os.environ["MLIGHT_CACHE_DIR"] = c.user_cache
        paths.append(str(record_gpu_costs(c.base, **values)))
    finally:
        if run_cache is not None:
            os.environ["MLIGHT_CACHE_DIR"] = run_cache
    return paths


def stage_multi(c: Check, until: float) -> dict:
    from multi_gpu import multi_gpu

    return multi_gpu(c.args, c.work, build_big(c.work / "big", c.args.layers, TINY if c.dry else BIG), log)


RUN = {"smoke": stage_smoke, "pcie": stage_pcie, "host": stage_host, "offload": stage_offload,
       "many-experts": stage_many_experts, "baseline": stage_baseline, "parity": stage_parity, "multi": stage_multi}


# ---- the report -----------------------------------------------------------------------------------------
def _run_lines(prefix: str, runs: list, pred0: dict) -> list[str]:
    lines = []
    for x in runs:
        pred = x.get("prediction", pred0)
        if "tokens_per_s" not in x:
            lines.append(f"         {prefix}  {x.get('schedule', ''):8} {x.get('error') or x.get('skipped')}"[:120])
            continue
        ls, pl = Busy(x["layer_seconds"]), Busy(pred["layer_seconds"])
        per = " ".join(f"{ls[k] * 1e3:.1f}:{pl.get(k, 0) * 1e3:.1f}" for k in RESOURCES)
        counts = (f" launches/waits/syncs {x['launches_per_layer_step']:.0f}/{x['waits_per_layer_step']:.0f}/"
                  f"{x['syncs_per_layer_step']:.1f} a layer" if "launches_per_layer_step" in x else "")
        lines.append(f"         {prefix}  {x['schedule']:8} {x['tokens_per_s']:8.1f} {pred['tokens_per_s']:10.1f} "
                     f"{x['fraction_of_pcie_bound']:6.0%} {x['peak_gpu_bytes'] / max(1, pred['gpu_bytes']):9.2f}  "
                     f"{per}  {x.get('variant', '')} mu={x.get('policy', {}).get('micro_batch_size', '')} "
                     f"pin {x.get('pin_seconds', 0)} s{counts}")
    return lines


def table(report: dict) -> str:
    st = report["stages"]
    lines = [f"GPU check — {report['device']} (torch {report['torch']}), {report.get('seconds', 0):.0f} s "
             f"of a {report['deadline_s']:.0f} s deadline"]
    head = "  tok/s  predicted  PCIe%  peak/plan   gpu  cpu_attn  h2d   d2h   (ms/layer measured:predicted)"
    for name in STAGES:
        r = st.get(name)
        if r is None:
            continue
        if "skipped" in r or "error" in r:
            lines.append(f"{name:8} {r.get('skipped') or r.get('error')}")
        elif name == "smoke":
            lines.append(f"smoke    tokens {'equal' if r['equal'] else 'DIFFER'} ({r['seconds']} s)"
                         + (" (cut short)" if r.get("cut_short") else ""))
        elif name == "parity":
            bad = [f"{x['family']}/{x['schedule']}/{x['paging']}" + (f" ({x['error']})" if x.get("error") else "")
                   for x in r["rows"] if not x["equal"]]
            lines.append(f"parity   {len(r['rows']) - len(bad)}/{len(r['rows'])} equal"
                         + (f"; differ: {', '.join(bad)}" if bad else "") + (" (cut short)" if r["cut_short"] else ""))
        elif name == "pcie":
            pin = f"; page-locking {r['pin_gbps']:.1f} GB/s" if r.get("pin_gbps") else ""
            lines.append(f"pcie     H2D {r['h2d_gbps']:.1f} GB/s, D2H {r['d2h_gbps']:.1f} GB/s "
                         f"(pinned: {r['pinned']}); H2D from pageable memory {r.get('h2d_pageable_gbps', 0):.1f} GB/s"
                         + pin + (f" — {r['note']}" if "note" in r else ""))
        elif name == "multi":
            from multi_gpu import table_lines

            lines += table_lines(r)
        elif name == "host":
            lines.append(f"host     {r['task_seconds'] * 1e6:.1f} µs/task (planner {r['planner_task_seconds'] * 1e6:.0f}), "
                         f"{r['op_seconds'] * 1e6:.1f} µs/op (planner {r['planner_op_seconds'] * 1e6:.0f})")
            if "per_call" in r:
                lines.append("         per call: " + ", ".join(f"{k} {v * 1e6:.1f} µs" for k, v in r["per_call"].items()))
        elif name == "offload":
            lines.append("offload  cap  schedule" + head)
            for row in r["rows"]:
                lines += _run_lines(f"{row['cap_gb']:4.0f}", row["runs"], row["prediction"])
                lines += [f"         {row['cap_gb']:4.0f}  not run: {x['variant']}: {x['why']}"
                          for x in row.get("not_run", [])]
                if row.get("load_seconds") is not None:
                    lines.append(f"         {row['cap_gb']:4.0f}  loaded once in {row['load_seconds']} s; page-locked "
                                 f"{row.get('pin_bytes', 0) / 1e9:.2f} GB in {row.get('pin_seconds', 0)} s")
        elif name == "many-experts":
            lines.append("experts  fmt  schedule" + head)
            for row in r["rows"]:
                if "prediction" not in row:
                    lines.append(f"         {row['format']:4} {row.get('skipped') or row.get('error')}")
                    continue
                lines += _run_lines(f"{row['format']:4}", row.get("runs", []), row["prediction"])
                if row.get("error") or row.get("note"):
                    lines.append(f"         {row['format']:4} {row.get('error') or row.get('note')}")
        elif name == "baseline":
            lines.append(f"baseline HF accelerate, N = {r['N']}: {r.get('tokens_per_s', float('nan')):.2f} tok/s; ours "
                         f"{r['ours_tokens_per_s']:.1f} ({r.get('ours_over_hf', float('nan')):.1f}x); GPU bytes in use "
                         f"before it: {r['gpu_bytes_before']:,}"
                         + (f"; out of memory at {', '.join(r['out_of_memory'])}" if r.get("out_of_memory") else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA GPU: run with --dry-run for the emulated one", file=sys.stderr)
        return 2
    c = Check(args)
    c.user_cache = os.environ.get("MLIGHT_CACHE_DIR")
    os.environ.setdefault("MLIGHT_CACHE_DIR", str(c.work / "cache"))
    # every wait on the device is bounded: a hung copy or kernel raises DeviceStalled instead of eating the lease
    os.environ.setdefault("MLIGHT_DEVICE_WAIT_S", str(STALL_S))
    print(plan_text(args.stages), flush=True)
    log(f"GPU check on {c.report['device']}; deadline {args.deadline:.0f} s; results in {args.out}")
    try:
        for name in args.stages:
            least, most = STAGES[name]
            left = c.left()
            if left < least:
                c.save(name, {"skipped": f"deadline: {left:.0f} s left, the stage needs {least} s"})
                log(f"{name}: skipped (deadline)")
                continue
            log(f"{name}: starting ({left:.0f} s left; planned {most} s)")
            t0 = time.monotonic()
            try:
                result = RUN[name](c, until=time.monotonic() + min(left, most) - 2)
            except Exception as e:  # a stage that breaks is reported; the next stages still run
                result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            result["stage_seconds"] = round(time.monotonic() - t0, 1)
            c.save(name, result)
            log(f"{name}: done in {result['stage_seconds']} s")
    finally:
        faulthandler.cancel_dump_traceback_later()
        if not args.dry_run:
            torch.cuda.set_per_process_memory_fraction(1.0)
    print(table(c.report))
    print(f"\nfull figures: {args.out / 'gpu_check.json'}")
    st = c.report["stages"]
    ok = st.get("smoke", {}).get("equal", True) and all(x["equal"] for x in st.get("parity", {}).get("rows", []))
    return 0 if ok and not any("error" in r for r in st.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
