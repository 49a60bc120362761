"""The steps of `Engine.load` that read and ready the model, each handed the previous one's result."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import ModelError, UsageError
from core.model.cpu import compute as cpu_compute
from core.model.cpu import ffn, int4, native, row_ops
from core.model.families import load_spec
from core.model.gguf.load import GGUFModel, find_gguf, load_gguf_weights
from core.model.gguf.load import load_spec as load_gguf_spec
from core.model.quant.dense import dense_cache
from core.model.quant.dense_spec import with_dense
from core.model.quant.formats import quantized_spec
from core.model.shard import local_spec, plan_shard
from core.model.spec import ModelSpec, torch_dtype
from core.model.weights import ModelWeights, load_weights
from core.plan.policy import expert_split
from core.runtime.device import Device
from core.telemetry import EventSink, WarningEvent


@dataclass(frozen=True)
class Checkpoint:
    model_dir: Path
    gguf: object | None  # core.model.gguf.load.GGUFModel
    spec: ModelSpec
    shard: object | None

    @property
    def mine(self) -> ModelSpec:  # with tensor parallelism, this rank's heads and expert slices
        return self.spec if self.shard is None else local_spec(self.spec, self.shard)


def read_checkpoint(model_dir: Path, tp) -> Checkpoint:
    paths = None if model_dir.is_dir() and (model_dir / "config.json").is_file() else find_gguf(model_dir)
    gguf = GGUFModel(paths) if paths is not None else None
    spec = load_gguf_spec(gguf) if gguf is not None else load_spec(model_dir)
    return Checkpoint(model_dir, gguf, spec, plan_shard(spec, tp.rank, tp.size) if tp is not None else None)


def read_weights(ck: Checkpoint, dtype, quant, quantize: str | None, pages_per_layer: int, use_cache: bool,
                 progress: EventSink, cpu_only: bool = False) -> tuple[ModelWeights, ModelSpec]:
    """`cpu_only`: GGUF stays blocks."""
    if ck.gguf is not None and ck.shard is not None:
        raise UsageError("tensor parallelism over a GGUF file is not supported yet",
                         "run it without --tensor-parallel, or use the model's safetensors release")
    if ck.gguf is not None:
        if quant is not None:
            raise UsageError(f"--quantize {quantize} applies to safetensors checkpoints; {ck.gguf.paths[0].name} "
                             "is a GGUF file and runs in its own format", "leave out --quantize")
        return load_gguf_weights(ck.gguf, ck.spec, dtype=dtype, pages_per_layer=pages_per_layer,
                                 progress=progress, cpu_only=cpu_only), ck.spec
    weights = load_weights(ck.model_dir, ck.spec, dtype=dtype, pages_per_layer=pages_per_layer, progress=progress,
                           quant=quant, use_cache=use_cache, shard=ck.shard)
    return weights, quantized_spec(ck.spec, quant)


def fit_on_device(config, dev: Device, ck: Checkpoint, spec: ModelSpec, weights: ModelWeights, quant):
    """On a GPU: as many resident experts as fit where nobody said, refusing bf16 that fp16 cannot hold."""
    mine = ck.mine
    if dev.accelerator and config.resident(mine.num_layers, mine.num_experts) is None:
        config = dataclasses.replace(config, resident_experts=_experts_that_fit(quantized_spec(mine, quant),
                                                                                weights.dtype, dev))
    if dev.accelerator and weights.dtype == torch.float16 and spec.torch_dtype != torch.float16:
        _check_fp16_range(weights)
    return config


def ready_for_cpu(config, ck: Checkpoint, spec: ModelSpec, weights: ModelWeights, cpu, quant, dense_fmt,
                  quantize_dense, use_cache: bool, progress: EventSink):
    """CPU-only: pack the experts (and `dense_fmt` projections) for the CPU's kernels; (CPU compute, spec)."""
    if config.ffn_on != "cpu":
        if quantize_dense:
            progress(WarningEvent("--quantize-dense applies to the CPU-only mode; the dense weights stay in "
                                  f"{weights.dtype_name} on the device"))
        return cpu, spec
    if weights.scheme is not None:  # quantized experts: their own CPU kernels (core.model.quant)
        if quant is not None and quant.name == "int4":
            int4.prepare(progress)  # its C kernel built here, with progress, before the experts ask for it
        shard = ck.shard
        cache = dense_cache(ck.model_dir, ck.mine, dense_fmt, weights.dtype, {"shard": f"{shard.rank}/{shard.size}"}
                            if shard else None) if use_cache else None
        weights.pack_for_cpu(progress, dense_format=dense_fmt, dense_cache=cache)
        spec = with_dense(spec, dense_fmt)
    elif cpu.pack:
        ffn.prepare(progress)  # a compile here, with progress, not inside the packing
        try:
            weights.pack_for_cpu(progress)
        except RuntimeError as e:  # e.g. "bf16 path needs the cpu support avx512bw ..."
            progress(WarningEvent(f"oneDNN refused to prepack the experts ({str(e).splitlines()[0]}); computing in "
                                  "float32 over the unpacked weights instead"))
            cpu = dataclasses.replace(cpu, pack=False, math="float32", direct_rows=cpu_compute.DIRECT_ROWS,
                                      reason=cpu.reason + "; but oneDNN refused to prepack, so not natively after all")
    if cpu.widens and weights.scheme is None:
        ffn.prepare(progress, widened=True)
        if weights.packs_widened():  # the experts widen in registers in one C call a layer
            weights.widen_dense(torch_dtype(cpu.math), pack=True, progress=progress)
            cpu = dataclasses.replace(cpu, fused=True)
        else:
            weights.widen_dense(torch_dtype(cpu.math))
    return cpu, spec


def prepare_kernels(config, progress: EventSink) -> None:
    """The native kernels the run's CPU side calls, built here with progress, not inside its first step."""
    if config.attention_on == "cpu":
        native.prepare(progress)
    if config.attention_on == "cpu" or config.ffn_on == "cpu":
        row_ops.prepare(progress)  # the step's norms, RoPE and cache writes


def shard_ops(tp, shard, spec: ModelSpec, quant):
    from core.runtime.distributed.tensor_parallel import ShardOps

    return ShardOps(tp, shard, spec), quantized_spec(local_spec(spec, shard), quant)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise ModelError(f"{model_dir} has no tokenizer files (tokenizer.json / tokenizer_config.json)",
                         "copy the tokenizer files that came with the model into the folder")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many types here; all mean the same to the user
        raise ModelError(f"cannot load the tokenizer in {model_dir}: {str(e).splitlines()[0]}",
                         "check the tokenizer files that came with the model") from e


def eos_ids(model_dir: Path, spec: ModelSpec, tokenizer) -> set[int]:
    ids = set(spec.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        with contextlib.suppress(OSError, ValueError):
            eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [eos])
    ids.add(tokenizer.eos_token_id)  # None (none said) goes with the rest that are no token
    return {i for i in ids if isinstance(i, int) and 0 <= i < spec.vocab_size}


def _experts_that_fit(spec: ModelSpec, dtype: torch.dtype, dev: Device) -> tuple[int, ...]:
    free, _ = dev.mem_get_info()
    scale = dtype.itemsize / spec.dtype_bytes
    L, E, eb = spec.num_layers, spec.num_experts, spec.expert_bytes * scale
    fixed = (spec.nonexpert_bytes + 2 * spec.layer_expert_bytes) * scale + min(2e9, 0.1 * free)  # + activations, KV
    LE = spec.moe_layers * E  # routed experts in all (dense layers hold none)
    n = max(0, min(LE, int((0.85 * free - fixed) // eb)))
    return tuple(expert_split(n / LE, L, E, [i for i in range(L) if not spec.is_moe(i)]))


def _check_fp16_range(weights: ModelWeights) -> None:  # bf16 weights beyond fp16's range would turn into inf
    for name, t in [(f"layer {i}", lw.flat) for i, lw in enumerate(weights.layers)] + list(weights.globals.items()):
        if not torch.isfinite(t).all():
            raise ModelError(f"{name} has weights beyond float16's range (±65504), and this GPU computes "
                             "bf16 checkpoints in float16", "run with --dtype float32")
