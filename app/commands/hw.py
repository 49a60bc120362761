"""`mlight hw`: what this machine has (GPUs, memory, cores, PCIe link, the CPU's instruction set) and what
a short probe measured (matmul rates per dtype, memory bandwidth), with the CPU compute the engine picks."""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("hw", help="show the detected and measured hardware",
                              description="Detect GPUs (NVML) and host memory and cores (psutil), then measure "
                                          "CPU/GPU matmul and memory and PCIe bandwidth; measurements are cached "
                                          "per machine ($MLIGHT_CACHE_DIR or the user cache dir).")
    p.add_argument("--refresh", action="store_true", help="measure again instead of using the cache")
    p.add_argument("--no-probe", action="store_true", help="detect only, measure nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object (the HardwareSpec)")
    return p


def run(args) -> int:
    from core.model.cpu.isa import cpu_isa
    from core.plan.hardware import detect, probe, probe_cache_path

    hw = detect()
    if not args.no_probe:
        hw = probe(hw, refresh=args.refresh)
    if args.json:
        print(json.dumps(hw.to_dict()))
        return 0
    measured = set(hw.measured)

    def tag(field: str) -> str:
        return "measured" if field in measured else ("datasheet" if hw.source != "detect" or field.startswith("gpu") else "estimate")

    lines = []
    if hw.has_gpu:
        free = f", {hw.gpu_mem_free_bytes / 2**30:.1f} GiB free" if hw.gpu_mem_free_bytes is not None else ""
        lines += [
            f"GPU        {hw.gpu_count}× {hw.gpu_name}, {hw.gpu_mem_bytes / 2**30:.1f} GiB{free}",
            f"  compute  {hw.gpu_flops / 1e12:.1f} TFLOP/s fp16 ({tag('gpu_flops')})",
            f"  memory   {hw.gpu_bw / 1e9:.0f} GB/s ({tag('gpu_bw')})",
            f"  link     {hw.pcie or '?'}: host→device {hw.h2d_bw / 1e9:.1f} GB/s ({tag('h2d_bw')}), "
            f"device→host {hw.d2h_bw / 1e9:.1f} GB/s ({tag('d2h_bw')})",
        ]
    else:
        lines.append("GPU        none found (no NVML library, driver or device): CPU-only mode")
    avail = f", {hw.cpu_mem_available_bytes / 1e9:.1f} GB available" if hw.cpu_mem_available_bytes is not None else ""
    lines += [f"CPU        {hw.cpu_cores} cores, {hw.cpu_mem_bytes / 1e9:.1f} GB RAM{avail}",
              f"  ISA      {hw.cpu_isa_text() if hw.cpu_isa else cpu_isa().label}"]
    if hw.cpu_matmul:
        threads = f", {hw.cpu_threads} thread{'s' if hw.cpu_threads != 1 else ''}" if hw.cpu_threads else ""
        lines.append("  matmul   " + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in hw.cpu_matmul.items())
                     + f" GFLOP/s (measured{threads})")
    else:
        lines.append(f"  compute  {hw.cpu_flops / 1e9:.0f} GFLOP/s fp32 ({tag('cpu_flops')})")
    lines.append(f"  memory   {hw.cpu_bw / 1e9:.1f} GB/s ({tag('cpu_bw')})")
    from core.model.cpu import compute, ffn, int4, native, panel_linear, row_ops

    maths = {}
    for storage, short in (("bfloat16", "bf16"), ("float16", "fp16")):
        if hw.cpu_isa:
            maths[storage], why = hw.cpu_math(storage)
        else:  # no ISA recorded (a preset or a hand-written file): what this machine would choose
            c = compute.choose(storage)
            maths[storage], why = c.math, c.reason
        lines.append(f"  {short} weights compute in {maths[storage]}: {why}")

    lines.append(f"  decode attention: {native.status()}")
    lines.append(f"  norm, RoPE, cache write: {row_ops.status()}")
    lines.append(f"  bf16 experts: {ffn.status(maths['bfloat16'])}")
    lines.append(f"  bf16 projections: {panel_linear.status(maths['bfloat16'])}")
    lines.append(f"  int4 experts: {int4.status()}")
    if not args.no_probe:
        lines.append(f"cache      {probe_cache_path(hw)}")
    print("\n".join(lines))
    return 0

