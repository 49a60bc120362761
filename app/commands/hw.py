"""`mlight hw`: what this machine has (GPUs, memory, cores, PCIe link) and what a short probe measured."""

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
    lines += [
        f"CPU        {hw.cpu_cores} cores, {hw.cpu_mem_bytes / 1e9:.1f} GB RAM{avail}",
        f"  compute  {hw.cpu_flops / 1e9:.0f} GFLOP/s fp32 ({tag('cpu_flops')})",
        f"  memory   {hw.cpu_bw / 1e9:.1f} GB/s ({tag('cpu_bw')})",
    ]
    if not args.no_probe:
        lines.append(f"cache      {probe_cache_path(hw)}")
    print("\n".join(lines))
    return 0
