"""The GGUF kernel's int8 path (core.model.cpu.gguf_blocks, "int8" and "int8_c"): activations quantized per 32
values, integer dots with the blocks' own integers.

Against a float64 reference of the same arithmetic (activations quantized as the kernel does, times
`gguf.quants.dequantize`'s weights) it may differ only by float32 summation; the SIMD dots (AVX-512 VNNI,
AVX2 `maddubs`) and the plain-C ones must agree bit for bit, on any input (one float order for both).
"""

from __future__ import annotations

import os

import pytest
import torch

from core.model.cpu import gguf_blocks
from gguf_files import FORMATS
from test_gguf_native import _blocks

pytestmark = pytest.mark.skipif(gguf_blocks.library() is None, reason="no C compiler: GGUF blocks expand per use")


def quantized(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernel reads it: per 32 values, scale max|x| / 127 and round half to even, in float32;
    returned as scale · integer in float64."""
    b = x.float().reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(b * inv).clamp(-127, 127)
    return (q.double() * d.double()).reshape(x.shape)


def _reference(x: torch.Tensor, deq: torch.Tensor) -> torch.Tensor:
    return quantized(x) @ deq.double().t()


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 8, 37])
def test_int8_path_is_quantized_activations_times_the_files_weights(kind, rows):
    raw, deq = _blocks(kind, 40, 768, seed=rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)) * 3
    want = _reference(x, deq)
    scale = want.abs().max().item()
    for path in ("int8", "int8_c"):
        got = gguf_blocks.linear(kind, x, raw, path=path)
        assert (got.double() - want).abs().max().item() <= 2e-6 * scale * 768 ** 0.5, path
    # bf16 in and out: the same, rounded once at the end
    xb = x.bfloat16()
    got = gguf_blocks.linear(kind, xb, raw, path="int8")
    torch.testing.assert_close(got.double(), _reference(xb, deq), rtol=8e-3, atol=8e-3 * scale)


@pytest.mark.parametrize("kind", FORMATS)
def test_simd_and_plain_c_dots_agree_bit_for_bit(kind):
    raw, _ = _blocks(kind, 33, 512, seed=5)
    for rows in (1, 2, 5, 9):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        simd, plain = (gguf_blocks.linear(kind, x, raw, path=p) for p in ("int8", "int8_c"))
        assert torch.equal(simd, plain)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_default_path_by_rows_and_dtype(kind):
    """int8 for bf16 activations up to the format's row bound; fp32 above it, and for float32 activations."""
    raw, _ = _blocks(kind, 8, 256)
    top = gguf_blocks.INT8_MAX_ROWS[kind]
    for rows, path in ((1, "int8"), (top, "int8"), (top + 1, "fp32")):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(gguf_blocks.linear(kind, x.bfloat16(), raw),
                           gguf_blocks.linear(kind, x.bfloat16(), raw, path=path))
        assert torch.equal(gguf_blocks.linear(kind, x, raw), gguf_blocks.linear(kind, x, raw, path="fp32"))


@pytest.mark.parametrize("up,down", [("Q8_0", "Q8_0"), ("Q4_K", "Q6_K"), ("Q5_K", "Q4_0"), ("MXFP4", "MXFP4")])
def test_one_tokens_experts_in_one_call_on_int8(up, down):
    """The fused one-token call: x quantized, each expert's silu(gate) · up quantized again before the down rows."""
    E, D, I = 4, 256, 512
    w13 = [_blocks(up, 2 * I, D, seed=e) for e in range(E)]
    w2 = [_blocks(down, D, I, seed=10 + e) for e in range(E)]
    g = torch.Generator().manual_seed(2)
    x, ids, wts = torch.randn(1, D, generator=g), torch.tensor([[3, 1]]), torch.tensor([[0.7, 0.3]])
    args = (x, ids, wts, (up, torch.stack([r for r, _ in w13])), (down, torch.stack([r for r, _ in w2])))
    got = gguf_blocks.moe(*args, path="int8")
    want = torch.zeros(1, D, dtype=torch.float64)
    for e, w in zip(ids[0].tolist(), wts[0].tolist()):
        gate, u = _reference(x, w13[e][1]).float().chunk(2, -1)  # the kernel keeps gate/up in float32
        h = torch.nn.functional.silu(gate) * u
        want += w * _reference(h, w2[e][1])
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert torch.equal(got, gguf_blocks.moe(*args, path="int8_c"))
    xb = x.bfloat16()  # the default for bf16 activations
    assert torch.equal(gguf_blocks.moe(xb, *args[1:]), gguf_blocks.moe(xb, *args[1:], path="int8"))


def test_the_build_has_the_isas_int8_dots():
    """AVX-512 VNNI where the CPU has it and torch may use AVX-512; AVX2's `maddubs` in the AVX2 lane."""
    lib = gguf_blocks.library()
    if os.environ.get("MLIGHT_AVX2_LANE") == "1":
        assert lib.simd == "AVX2 maddubs", lib.flags
    elif "-mavx512vnni" in lib.flags:
        assert lib.simd == "AVX-512 VNNI"
