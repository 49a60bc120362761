"""Fused MoE GEMM in Triton, vLLM/SGLang's design: one launch, a program a block of BM pairs of one expert by BN
columns, dequantizing in registers (`formats.dequantize`'s fp32 arithmetic), accumulating in fp32; a static grid.
Legend: T = tokens, k = top_k, E = experts, n = experts in the part, N = outputs, K = inputs, p = pair.
"""

from __future__ import annotations

import functools
import math

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine keeps its torch paths
    triton = tl = None

# format -> (kernel code, bytes of one GGUF block, values in it); 0 stands for bf16/fp16 weights
_CODES = {None: (0, 0, 1), "int8": (1, 0, 1), "int4": (2, 0, 1), "mxfp4": (3, 0, 32), "Q8_0": (4, 34, 32),
          "Q4_0": (5, 18, 32), "MXFP4": (6, 17, 32), "Q4_K": (7, 144, 256), "Q5_K": (8, 176, 256),
          "Q6_K": (9, 210, 256)}
_PARTS = {0: ("w", None), 1: ("q", "scale"), 2: ("q", "sz"), 3: ("blocks", "scales")}  # else ("raw", None)
MMA_FROM = (8, 0)  # from this capability on tl.dot runs on tensor cores (mma v2+); below it, FMA


def unsupported(fmt, dtype, capability: tuple[int, int]) -> str | None:
    """None when this kernel runs (format, compute dtype) on a GPU of `capability`, else why not."""
    if triton is None:
        return "triton is not installed"
    name = getattr(fmt, "name", None)
    if name not in _CODES:
        return f"the fused MoE kernel does not read {name} weights"
    import torch

    if dtype not in (torch.float16, torch.bfloat16):
        return f"the fused MoE kernel computes in fp16 or bf16, not {dtype}"
    if tuple(capability) < (7, 5):
        major, minor = capability
        return f"compute capability {major}.{minor} is older than the T4 (7.5), the oldest GPU mlight plans for"
    if dtype == torch.bfloat16 and tuple(capability) < MMA_FROM:
        return ("bf16 needs SM80+: SM75 has no bf16 arithmetic (triton 3.9 would emulate it through fp32 FMA); "
                "compute in fp16 there")
    return None


def pick_block_m(pairs: int, experts: int) -> int:
    """BM for T·k `pairs` over E experts: near an expert's mean pairs, since each expert pads its run to BM."""
    per_expert = pairs / max(1, min(experts, pairs))
    return 16 if per_expert <= 24 else 32 if per_expert <= 96 else 64


def moe_gemm(a, stack, fmt, out, sorted_ids, block_expert, n_padded, *, top_k: int, block_m: int,
             expert_base: int = 0, route_w=None) -> None:
    """out[p] = a[p // top_k] @ dequant(stack[e - expert_base]).T (· route_w[p]) for the pairs of this part's
    experts, other rows left as they are; one launch, no host sync. a: [T, K] (top_k = k) or [T·k, K]; stack:
    {"w": [n, N, K]} or `fmt.parts`' suffixes; out: [T·k, N]; sorted_ids, block_expert, n_padded: `moe_align`'s."""
    code, block_bytes, block_vals = _CODES[getattr(fmt, "name", None)]
    main, aux = _PARTS.get(code, ("raw", None))
    w = stack[main]
    s = stack[aux] if aux else w
    pairs, N = out.shape
    K = a.shape[1]
    if code == 2:
        assert s.stride(-1) == 1 and s.stride(-2) == 2, "int4 scale/zero pairs must be packed"
    assert w.stride(-1) == 1 and a.stride(1) == 1 and out.stride(1) == 1
    if code == 3:  # mxfp4's [N, K/32, 16] blocks: a row's K/2 bytes in a row
        assert w[0, 0].is_contiguous()
    BN = 64 if N > 32 else 32
    BK = 32 if code >= 3 else min(64, fmt.group) if code == 2 else 64  # a block format's tile is one block
    grid = (sorted_ids.numel() // block_m, math.ceil(N / BN))
    import torch
    from triton import knobs

    interpret = bool(knobs.runtime.interpret)
    _kernel(interpret)[grid](
        a, w, s, out, sorted_ids, block_expert, n_padded, route_w if route_w is not None else out,
        N, K, pairs, expert_base, w.shape[0],
        a.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1) if s.dim() > 1 else 0, out.stride(0),
        TOP_K=top_k, FMT=code, GROUP=getattr(fmt, "group", 0) or 1, BLOCK_BYTES=block_bytes,
        BLOCK_VALS=block_vals, HAS_ROUTE=route_w is not None, DOT_F32=interpret and a.dtype == torch.bfloat16,
        BM=block_m, BN=BN, BK=BK,
        enable_fp_fusion=True)  # fused multiply-adds, as measured; triton 3.10 turns its default off


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool):
    """The jitted kernel, made on first launch: TRITON_INTERPRET is read at decoration, which tests set late."""
    return triton.jit(_moe_gemm)


def _moe_gemm(a_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, block_expert_ptr, n_padded_ptr, route_ptr,
              N, K, pairs, expert_base, n_experts,
              stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
              TOP_K: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_BYTES: tl.constexpr,
              BLOCK_VALS: tl.constexpr, HAS_ROUTE: tl.constexpr, DOT_F32: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BM >= tl.load(n_padded_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m) - expert_base  # -1 (no block) is below any part's base
    if (e < 0) | (e >= n_experts):
        return
    e = e.to(tl.int64)  # a stack of many experts passes 2^31 bytes

    offs_m = pid_m * BM + tl.arange(0, BM)
    p = tl.load(sorted_ptr + offs_m)
    live = p < pairs  # the sentinel T·k pads each expert's run
    a_rows = a_ptr + (p // TOP_K).to(tl.int64)[:, None] * stride_am
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    w_rows = w_ptr + e * stride_we + n64[None, :] * stride_wn  # [1, BN]
    s_rows = s_ptr + e * stride_se + n64[None, :] * stride_sn
    if FMT == 1:  # int8: one fp32 scale a row
        scale = tl.load(s_rows, mask=n_ok[None, :], other=0.0)

    # tl.full, not tl.zeros: zeros is a @jit function of triton.language.standard, jitted for the GPU when triton
    # was imported before TRITON_INTERPRET was set, which the interpreter cannot call; builtins work either way
    acc = tl.full((BM, BN), 0.0, tl.float32)
    # A quantized tile never straddles a scale: BK divides int4's group, and is 32 for the block formats (one
    # block, or one 32-value sub-block of a K-quant's 256), so scales load once a tile as [1, BN] rows.
    nmask = n_ok[None, :]
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < K
        kk = offs_k[:, None]  # [BK, 1]
        wmask = k_ok[:, None] & nmask
        x = tl.load(a_rows + offs_k[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
        if FMT == 0:
            wt = tl.load(w_rows + kk, mask=wmask, other=0.0)
        elif FMT == 1:
            wt = tl.load(w_rows + kk, mask=wmask, other=0).to(tl.float32) * scale
        elif FMT == 2:  # int4: even k in the low nibble; sz = (scale, zero) bf16 per group of GROUP inputs
            byte = tl.load(w_rows + kk // 2, mask=wmask, other=0).to(tl.int32)
            q = ((byte >> ((kk % 2) * 4)) & 15).to(tl.float32)
            sz = s_rows + (k0 // GROUP) * 2
            wt = (q - 8.0) * tl.load(sz, mask=nmask, other=0.0).to(tl.float32) \
                + tl.load(sz + 1, mask=nmask, other=0.0).to(tl.float32)
        elif FMT == 3 or FMT == 6:  # mxfp4: e2m1 values times 2^(e - 127), e8m0 e per 32 inputs
            if FMT == 3:  # gpt-oss: e2m1 pairs (even k low), exponents apart
                byte = tl.load(w_rows + kk // 2, mask=wmask, other=0).to(tl.int32)
                q = (byte >> ((kk % 2) * 4)) & 15
                ex = tl.load(s_rows + k0 // 32, mask=nmask, other=127).to(tl.int32)
            else:  # GGUF: e u8 | 16 bytes, low nibbles are values 0..15, high 16..31 (2^(e-128) · 2·e2m1)
                blk = w_rows + (k0 // 32) * 17
                i = kk % 32
                q = (tl.load(blk + 1 + i % 16, mask=wmask, other=0).to(tl.int32) >> ((i // 16) * 4)) & 15
                ex = tl.load(blk, mask=nmask, other=127).to(tl.int32)
            m = (q & 1).to(tl.float32)
            em = (q >> 1) & 3
            mag = tl.where(em == 0, 0.5 * m, (2.0 + m) * (1 << em).to(tl.float32) * 0.25)  # 0 .5 1 1.5 2 3 4 6
            # 2^(ex - 127) from its bits, exactly (e = 0 is the subnormal 2^-127, e = 255 is inf like ldexp)
            pow2 = tl.where(ex == 0, 5.877471754111438e-39, (ex << 23).to(tl.float32, bitcast=True))
            wt = tl.where(q >= 8, -mag, mag) * pow2
        else:  # GGUF blocks
            blk = w_rows + (k0 // BLOCK_VALS) * BLOCK_BYTES  # [1, BN] this tile's block in each row
            i0 = k0 % BLOCK_VALS  # where the tile starts in its block
            i = i0 + tl.arange(0, BK)[:, None]  # [BK, 1]
            d_at = blk + 208 if FMT == 9 else blk  # the f16 scale d: Q6_K keeps it last
            d = (tl.load(d_at, mask=nmask, other=0).to(tl.uint16)
                 | (tl.load(d_at + 1, mask=nmask, other=0).to(tl.uint16) << 8)).to(tl.float16, bitcast=True)
            d = d.to(tl.float32)
            if FMT == 4:  # Q8_0: d f16 | q int8[32]
                wt = tl.load(blk + 2 + i, mask=wmask, other=0).to(tl.int8, bitcast=True).to(tl.float32) * d
            elif FMT == 5:  # Q4_0: d f16 | 16 bytes, low nibbles are values 0..15, high 16..31
                q = (tl.load(blk + 2 + i % 16, mask=wmask, other=0).to(tl.int32) >> ((i // 16) * 4)) & 15
                wt = d * (q - 8).to(tl.float32)
            elif FMT == 9:  # Q6_K: ql[128] | qh[64] | int8 scales[16] | d f16; 16 values a scale
                half = i // 128
                r = i % 128
                lo = (tl.load(blk + half * 64 + r % 64, mask=wmask, other=0).to(tl.int32) >> ((r // 64) * 4)) & 15
                hi = (tl.load(blk + 128 + half * 32 + r % 32, mask=wmask, other=0).to(tl.int32) >> ((r // 32) * 2)) & 3
                sc = tl.load(blk + 192 + i // 16, mask=wmask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
                wt = (d * sc) * ((lo | (hi << 4)) - 32).to(tl.float32)
            else:  # Q4_K / Q5_K: d, dmin f16 | 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32
                dmin = (tl.load(blk + 2, mask=nmask, other=0).to(tl.uint16)
                        | (tl.load(blk + 3, mask=nmask, other=0).to(tl.uint16) << 8)).to(tl.float16, bitcast=True)
                j = i0 // 32  # the tile's sub-block
                b0 = tl.load(blk + 4 + j % 4, mask=nmask, other=0).to(tl.int32)
                b1 = tl.load(blk + 8 + j % 4, mask=nmask, other=0).to(tl.int32)
                b2 = tl.load(blk + 12 + j % 4, mask=nmask, other=0).to(tl.int32)
                sc = tl.where(j < 4, b0 & 63, (b2 & 15) | ((b0 >> 2) & 48)).to(tl.float32)
                mn = tl.where(j < 4, b1 & 63, (b2 >> 4) | ((b1 >> 2) & 48)).to(tl.float32)
                qs = blk + 16 if FMT == 7 else blk + 48  # Q5_K keeps the fifth bits qh[32] first
                q = (tl.load(qs + (j // 2) * 32 + i % 32, mask=wmask, other=0).to(tl.int32) >> ((j % 2) * 4)) & 15
                if FMT == 8:
                    q = q | (((tl.load(blk + 16 + i % 32, mask=wmask, other=0).to(tl.int32) >> j) & 1) << 4)
                wt = (d * sc) * q.to(tl.float32) - dmin.to(tl.float32) * mn
        wt = wt.to(x.dtype)  # rounded once to the compute dtype, as the expand path's weights
        if DOT_F32:  # triton's interpreter multiplies bf16's storage bits: the same values in fp32 (exact products)
            acc = tl.dot(x.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, wt, acc)

    if HAS_ROUTE:
        acc = acc * tl.load(route_ptr + p, mask=live, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + p.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & n_ok[None, :])
