"""The routed experts on an accelerator in a number of launches that does not depend on E: pairs aligned into
blocks of one expert (`mlight::moe_align`), then `mlight::moe_gemm` over every block (the Triton kernel where it runs,
else a torch form, a chunk of blocks at a time). Both are torch.library ops with fake implementations, so a launch
count, a CUDA graph and the emulated device each see one op. Legend: moe_align's, D = hidden, I = expert
intermediate, N × K = one expert's matrix (outputs × inputs).
"""

from __future__ import annotations

import functools

import torch

from core.model.kernels import triton_module
from core.model.limits import FUSED_CHUNK_BYTES, FUSED_MAX_TOKENS, fused_block_rows
from core.model.moe_align import moe_align, padded_slots
from core.model.quant.formats import Format, dequantize

def expert_path(quantized: bool, tokens: int, grouped_mm: bool, forced: bool | None = None) -> str:
    """"grouped" or "fused" for `tokens` tokens; `grouped_mm`: its kernel runs here; `forced`: the caller's.
    grouped_mm never takes quantized experts (it reads one dtype), and dense ones above a decode step's expert
    batch only, where its tensor-core tiles win."""
    if quantized or not grouped_mm or forced is False:
        return "fused"
    return "grouped" if forced or tokens > FUSED_MAX_TOKENS else "fused"


def fused_experts(h: torch.Tensor, parts: list[dict], weights: torch.Tensor, idx: torch.Tensor, act,
                  backend: str | None = None) -> torch.Tensor:
    """h [T, D], weights/idx [T, k] -> [T, D]; `parts` as device_experts'."""
    T, k = idx.shape
    E = sum(len(p["quant"]) if "quant" in p else p["w13"].shape[0] for p in parts)
    up, down = _matrices(parts)
    triton = (backend == "triton" if backend is not None else  # else wherever the kernel takes every matrix
              h.is_cuda and all(_triton_runs(m[0], h.dtype, h.device.index or 0) for m in (*up, down)))
    bm = (triton_module("fused_moe_triton").pick_block_m(T * k, E) if triton  # the kernel's choice, or BM
          else fused_block_rows(T * k, E))
    sorted_ids, block_expert, n_padded = torch.ops.mlight.moe_align(idx, E, bm)
    pair_e = idx.reshape(-1)
    run = functools.partial(torch.ops.mlight.moe_gemm, sorted_ids=sorted_ids, block_expert=block_expert,
                            n_padded=n_padded, block_m=bm, triton=triton)
    gus = [run(h, stacks, fmt, top_k=k, route_w=None, biases=bias, pair_expert=pair_e if bias else None)
           for fmt, stacks, bias in up]
    mid = act(gus[0] if len(gus) == 1 else torch.cat(gus, -1))
    gus = None  # each intermediate goes as soon as the next is made (the planner counts them so)
    fmt, stacks, bias = down
    ys = run(mid, stacks, fmt, top_k=1, route_w=weights.reshape(-1), biases=bias, pair_expert=pair_e if bias else None)
    mid = None
    return ys.view(T, k, -1).sum(1)  # pair p = t·k + j: each token's k rows are adjacent


def _matrices(parts: list[dict]):
    """([(fmt, stacks, biases) per up matrix], that of down) over all parts, stacks in Format.parts order."""
    first = parts[0]
    if "quant" not in first:
        def dense(name, bias):
            return "", [p[name] for p in parts], [p[bias] for p in parts if bias in p]
        return [dense("w13", "b13")], dense("w2", "b2")
    scheme = first["quant"].scheme
    if any(p["quant"].scheme != scheme for p in parts):
        raise ValueError("a layer's expert parts are in different formats")

    def quant(m, bias):
        stacks = [p["quant"].parts[f"{m.name}.{x.suffix}"] for p in parts for x in m.fmt.parts(m.n, m.k)]
        return m.fmt.label, stacks, [p[bias] for p in parts if bias in p]

    up = [quant(m, "b13" if len(scheme.up) == 1 else "") for m in scheme.up]
    if len(scheme.up) > 1 and "b13" in first:
        raise ValueError("expert biases with gate and up in separate matrices")
    return up, quant(scheme.down, "b2")


_format = functools.lru_cache(maxsize=None)(Format.from_label)  # the ops' `fmt`: a label, "" when unquantized


@functools.lru_cache(maxsize=None)
def _triton_runs(fmt_key: str, dtype: torch.dtype, index: int) -> bool:
    ft = triton_module("fused_moe_triton")
    return ft is not None and ft.unsupported(_format(fmt_key), dtype, torch.cuda.get_device_capability(index)) is None


@torch.library.custom_op("mlight::moe_align", mutates_args=())
def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kernel = triton_module("moe_align_triton") if topk_ids.is_cuda else None
    if kernel is not None:  # one launch, where the torch form is about 15
        return kernel.moe_align(topk_ids, num_experts, block_m)
    return moe_align(topk_ids, num_experts, block_m)


@_align.register_fake
def _(topk_ids, num_experts, block_m):
    S = padded_slots(topk_ids.numel(), num_experts, block_m)
    i32 = dict(dtype=torch.int32, device=topk_ids.device)
    return torch.empty(S, **i32), torch.empty(S // block_m, **i32), torch.empty(1, **i32)


@torch.library.custom_op("mlight::moe_gemm", mutates_args=())
def _gemm(a: torch.Tensor, stacks: list[torch.Tensor], fmt: str, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
          n_padded: torch.Tensor, top_k: int, block_m: int, route_w: torch.Tensor | None, biases: list[torch.Tensor],
          pair_expert: torch.Tensor | None, triton: bool) -> torch.Tensor:
    """One projection of every routed pair: out[p] = (a[p // top_k] @ W_e.T + b_e) · route_w[p]. `stacks`: each
    part's tensors, parts covering experts 0..E−1 in order; `pair_expert` [P] is needed with `biases`."""
    P, N, K = a.shape[0] * top_k, stacks[0].shape[1], a.shape[1]
    f = _format(fmt)
    per = 1 if f is None else len(f.parts(N, K))
    parts = [stacks[i:i + per] for i in range(0, len(stacks), per)]
    if triton:
        return _gemm_triton(a, f, parts, N, K, sorted_ids, block_expert, n_padded, top_k, block_m, route_w, biases,
                            pair_expert)
    return _gemm_torch(a, f, parts, N, K, sorted_ids, block_expert, top_k, block_m, route_w, biases)


@_gemm.register_fake
def _(a, stacks, fmt, sorted_ids, block_expert, n_padded, top_k, block_m, route_w, biases, pair_expert, triton):
    return a.new_empty(a.shape[0] * top_k, stacks[0].shape[1])


def _gemm_triton(a, f, parts, N, K, sorted_ids, block_expert, n_padded, top_k, block_m, route_w, biases, pair_expert):
    ft = triton_module("fused_moe_triton")
    out = a.new_zeros(a.shape[0] * top_k, N)
    base = 0
    for stack in parts:
        st = {"w": stack[0]} if f is None else {x.suffix: t for x, t in zip(f.parts(N, K), stack)}
        ft.moe_gemm(a, st, f, out, sorted_ids, block_expert, n_padded, top_k=top_k, block_m=block_m,
                    expert_base=base, route_w=None if biases else route_w)
        base += stack[0].shape[0]
    if biases:  # before the routing weight: (x·Wᵀ + b)·w
        out += torch.cat(biases).index_select(0, pair_expert)
        if route_w is not None:
            out *= route_w[:, None]
    return out


def _gemm_torch(a, f, parts, N, K, sorted_ids, block_expert, top_k, block_m, route_w, biases):
    """Each block's expert gathered and dequantized beside its rows, a batched matmul; strays go to trash row P."""
    P = a.shape[0] * top_k
    nb = block_expert.shape[0]
    out = a.new_zeros(P + 1, N)
    ids_all = sorted_ids.view(nb, block_m).long()
    rw = None if route_w is None else torch.cat([route_w, route_w.new_zeros(1)])
    # gathered bytes a block: the matrix in the compute dtype, and dequantizing's float32 temporaries
    chunk = max(1, FUSED_CHUNK_BYTES // (N * K * (a.element_size() + (12 if f is not None else 0))))
    base = 0
    for i, stack in enumerate(parts):
        n = stack[0].shape[0]
        for c0 in range(0, nb, chunk):
            be = block_expert[c0:c0 + chunk].long() - base
            mine = (be >= 0) & (be < n)
            e = be.clamp(0, n - 1)
            w = (stack[0].index_select(0, e).to(a.dtype) if f is None else  # [c, N, K]: only their bytes are read
                 dequantize(f, {x.suffix: t.index_select(0, e) for x, t in zip(f.parts(N, K), stack)}, a.dtype))
            ids = torch.where(mine[:, None], ids_all[c0:c0 + chunk], P)
            x = a.index_select(0, ids.clamp(max=P - 1).flatten() // top_k).view(*ids.shape, K)
            y = torch.bmm(x, w.transpose(1, 2))  # [c, BM, N]
            if biases:
                y += biases[i].index_select(0, e)[:, None, :]
            if rw is not None:
                y *= rw.index_select(0, ids.flatten()).view(*ids.shape, 1)
            out.index_copy_(0, ids.flatten(), y.flatten(0, 1))  # only the trash row is written twice
        base += n
    return out[:P]
