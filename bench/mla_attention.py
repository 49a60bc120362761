"""MLA decode attention on the CPU, three ways, side by side in one run:

  latent    mlight: the cache holds each token's latent c and rope key (R + dr numbers); the query
            arrives absorbed (W_UKᵀ q_nope, done on the accelerator) and attention runs over the latents
            as multi-query attention; W_UV is applied back on the accelerator (core.model.mla.attend).
  expand    the cache holds latents, and the CPU task expands K and V from them (kv_b) every step,
            then runs ordinary attention — what a latent cache costs without absorption.
  full-kv   the cache holds the expanded K and V of every token (H·(dn+dr) + H·dv numbers), as a
            GQA-style store would: no expansion, but the bytes per token that big batches must fit.

For DeepSeek-V2-Lite and DeepSeek-V3 shapes it prints, per decode step of one layer, the CPU time and
the cache bytes, with ratios against `latent`.

    python bench/mla_attention.py [--batch 16] [--contexts 512 2048] [--dtype bfloat16] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.model import mla  # noqa: E402
from core.model.kvcache import LatentStore, Rows  # noqa: E402
from core.model.spec import MLASpec, ModelSpec  # noqa: E402

SHAPES = {  # heads, kv_lora_rank, qk_rope, qk_nope, v_head
    "DeepSeek-V2-Lite": (16, 512, 64, 128, 128),
    "DeepSeek-V3": (128, 512, 64, 128, 128),
}


def spec_for(H, R, dr, dn, dv) -> ModelSpec:
    return ModelSpec(architecture="DeepseekV3ForCausalLM", family="deepseek_v3", num_layers=1, hidden_size=1024,
                     num_heads=H, num_kv_heads=H, head_dim=dn + dr, vocab_size=8, num_experts=1, top_k=1,
                     expert_intermediate=1, mla=MLASpec(0, R, dn, dr, dv), attn_scale=(dn + dr) ** -0.5)


def timed(fn, repeat: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(name, B, T, dtype, repeat) -> list[tuple[str, float, int]]:
    H, R, dr, dn, dv = SHAPES[name]
    spec = spec_for(H, R, dr, dn, dv)
    g = torch.Generator().manual_seed(0)
    store = LatentStore(B, R + dr, T + 1, dtype, pin=False)
    store.lat.copy_(torch.randn(store.lat.shape, generator=g).to(dtype))
    rows = Rows(list(range(B)), [T] * B)
    kv_b = (torch.randn(H * (dn + dv), R, generator=g) * R ** -0.5).to(dtype)
    payload = torch.randn(B, (H + 1) * (R + dr), generator=g).to(dtype)
    out = []

    def latent():
        mla.attend(spec, {"kv_b": kv_b}, payload, store, rows)

    q_full = torch.randn(B, H, 1, dn + dr, generator=g).to(dtype)

    def expand():  # the CPU task expands K/V from the cached latents, then attends
        lat = store.lat[:, :T + 1]
        c, k_pe = lat.split([R, dr], dim=-1)
        k_nope, v = F.linear(c, kv_b).view(B, T + 1, H, dn + dv).split([dn, dv], dim=-1)
        k = torch.cat((k_nope, k_pe[:, :, None, :].expand(B, T + 1, H, dr)), dim=-1)
        F.scaled_dot_product_attention(q_full, k.transpose(1, 2), v.transpose(1, 2), scale=spec.scale)

    k_cache = torch.randn(B, H, T + 1, dn + dr, generator=g).to(dtype)
    v_cache = torch.randn(B, H, T + 1, dv, generator=g).to(dtype)

    def full_kv():
        F.scaled_dot_product_attention(q_full, k_cache, v_cache, scale=spec.scale)

    es = torch.empty((), dtype=dtype).element_size()
    out.append(("latent", timed(latent, repeat), B * (T + 1) * (R + dr) * es))
    out.append(("expand", timed(expand, repeat), B * (T + 1) * (R + dr) * es))
    out.append(("full-kv", timed(full_kv, repeat), B * (T + 1) * H * (dn + dr + dv) * es))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), load {load:.1f}, {args.dtype}")
    print(f"{'model':18s} {'ctx':>6s} {'form':8s} {'ms/step':>9s} {'vs latent':>10s} {'cache MB':>9s} {'vs latent':>10s}")
    for name in args.shapes:
        for T in args.contexts:
            rows = run(name, args.batch, T, dtype, args.repeat)
            base_t, base_b = rows[0][1], rows[0][2]
            for form, sec, nbytes in rows:
                print(f"{name:18s} {T:6d} {form:8s} {sec * 1e3:9.2f} {sec / base_t:9.2f}x {nbytes / 1e6:9.1f} "
                      f"{nbytes / base_b:9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
