"""The GGUF kernel's integer paths (core.model.cpu.gguf_blocks): "int8" and "int8_c", activations quantized to int8
per 32 values, integer dots with the blocks' own integers; "int16" and "int16_c" for the K-quants, activations
int16 per 256 values, a super-block's whole dot summed as an integer (the SIMD one unpacking the blocks in
registers, the plain C through a decoded row: two ways to the same integers).

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


def quantized(x: torch.Tensor, group: int = 32, top: int | None = None) -> torch.Tensor:
    """x [M, K] as the kernel reads it, in float64: per `group` values a scale d = max|x| / top and x / d rounded
    half to even, in float32; top 127 (int8), or by default 16383 for group 256 (the K-quants' "int16": int16
    per 256)."""
    top = top or (16383 if group == 256 else 127)
    b = x.float().reshape(x.shape[0], -1, group)
    d = b.abs().amax(-1, keepdim=True) / top
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(b * inv).clamp(-top, top)
    return (q.double() * d.double()).reshape(x.shape)


def _reference(x: torch.Tensor, deq: torch.Tensor, group: int = 32, top: int | None = None) -> torch.Tensor:
    return quantized(x, group, top) @ deq.double().t()


K_QUANTS = [k for k in FORMATS if k.endswith("_K")]


def _group(kind: str) -> int:
    return 256 if kind in K_QUANTS else 32


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


@pytest.mark.parametrize("kind", [k for k in FORMATS if k not in K_QUANTS])  # the K-quants take int16
def test_two_weight_row_tiles_agree_with_plain_c_on_odd_shapes(kind):
    """From two activation rows the SIMD int8 path takes two weight rows a tile (signed weights against the
    activations as unsigned bytes q + 128): an odd weight row count (the last row alone), an odd block count
    (K = 96: a half vector at the end), rows past a tile of 4, and two threads give plain C's floats bit for
    bit, within float32 summation of the reference."""
    threads = torch.get_num_threads()
    for n, k in ((7, 96), (33, 1024)):
        raw, deq = _blocks(kind, n, k, seed=n)
        for rows in (2, 3, 5, 9, 37):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
            plain = gguf_blocks.linear(kind, x, raw, path="int8_c")
            want = _reference(x, deq)
            assert (plain.double() - want).abs().max().item() <= 2e-6 * want.abs().max().item() * k ** 0.5
            for t in (1, 2):
                torch.set_num_threads(t)
                try:
                    assert torch.equal(gguf_blocks.linear(kind, x, raw, path="int8"), plain), (n, k, rows, t)
                finally:
                    torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", K_QUANTS)
@pytest.mark.parametrize("rows", [1, 5, 8, 37])
def test_k_quants_int16_path_is_quantized_activations_times_the_files_weights(kind, rows):
    """"int16": int16 activations with one scale a super-block, the whole super-block's dot summed in int32."""
    raw, deq = _blocks(kind, 40, 768, seed=rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)) * 3
    x[:, 300] = 40  # one large value: its super-block's scale, not its neighbours'
    want = _reference(x, deq, 256)
    scale = want.abs().max().item()
    for path in ("int16", "int16_c"):
        got = gguf_blocks.linear(kind, x, raw, path=path)
        assert (got.double() - want).abs().max().item() <= 2e-6 * scale * 768 ** 0.5, path
    # finer than int8 a 32: closer to the unquantized product
    exact = x.double() @ deq.double().t()
    err16, err8 = ((gguf_blocks.linear(kind, x, raw, path=p).double() - exact).abs().max().item()
                   for p in ("int16", "int8"))
    assert err16 < err8 / 10, (err16, err8)
    xb = x.bfloat16()
    got = gguf_blocks.linear(kind, xb, raw, path="int16")
    torch.testing.assert_close(got.double(), _reference(xb, deq, 256), rtol=8e-3, atol=8e-3 * scale)


@pytest.mark.parametrize("kind", K_QUANTS)
def test_k_quants_int16_simd_and_plain_c_agree_bit_for_bit(kind):
    """The SIMD path unpacks the blocks in registers, a tile of rows at a time or (more rows) all of them, in
    passes of 64; the plain C decodes the row into a buffer: the same integers and floats either way."""
    raw, _ = _blocks(kind, 33, 512, seed=5)
    for rows in (1, 2, 3, 4, 5, 9, 37, 70):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 10 ** (rows % 3)
        simd, plain = (gguf_blocks.linear(kind, x, raw, path=p) for p in ("int16", "int16_c"))
        assert torch.equal(simd, plain), rows


@pytest.mark.parametrize("kind", FORMATS)
def test_simd_quantizer_gives_the_plain_c_integers(kind):
    """With AVX-512 the activations are quantized 16 values at a time, on the plain-C path one at a time: ties
    (scale exactly 1, every value n + 1/2) rounded half to even, a block of zeros, values at the clamp, tiny
    and large rows, fp32 and bf16 in, give the same integers and scales, so outputs equal bit for bit and the
    tie row equals the float64 product of its even-rounded integers within float32 summation."""
    group = _group(kind)
    top = 16383 if group == 256 else 127
    path = gguf_blocks.integer_path(kind)
    K = 1024
    raw, deq = _blocks(kind, 21, K, seed=11)
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(11)) * 3
    x[1] = (torch.arange(K) * 7 % (2 * top) - top + 0.5).float()  # every value a tie: -top + 1/2 .. top - 1/2
    x[1, ::group] = top  # each block's max: d = top / top = 1
    x[2, group:3 * group] = 0  # whole blocks of zeros: d = 0
    x[3] *= 1e-30
    x[4] *= 1e30
    x[5, ::5] = -x[5].abs().max()  # many values at -max|x|: the clamp's edge
    for xs in (x, x.bfloat16()):
        simd, plain = (gguf_blocks.linear(kind, xs, raw, path=p) for p in (path, path + "_c"))
        assert torch.equal(simd, plain), xs.dtype
    want = torch.round(x[1:2].double()) @ deq.double().t()  # torch.round: half to even
    got = gguf_blocks.linear(kind, x[1:2], raw, path=path).double()
    assert (got - want).abs().max().item() <= 2e-6 * want.abs().max().item() * K ** 0.5


def test_int16_sums_of_the_largest_q6_k_weights_stay_exact():
    """Q6_K's largest weight, -128 · (0 - 32) = 4096, times the largest activations: 32 products a lane reach
    2^31 - 2^17, still an int32."""
    import gguf
    import numpy as np

    block = np.zeros(210, dtype=np.uint8)
    block[192:208] = 0x80  # sub-scales -128, every 6-bit integer 0
    block[208:210] = (0x00, 0x3C)  # d = 1.0
    raw = torch.from_numpy(np.tile(block, (4, 2)))  # 4 rows of K = 512
    deq = torch.from_numpy(np.array(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q6_K)))
    x = torch.ones(3, 512)
    x[1] = -1
    want = _reference(x, deq.reshape(4, 512), 256)
    for path in ("int16", "int16_c"):
        torch.testing.assert_close(gguf_blocks.linear("Q6_K", x, raw, path=path).double(), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K"])
def test_default_path_by_rows_and_dtype(kind):
    """For bf16 activations up to the format's row bound int8 (the K-quants: int16); fp32 above it, and for
    float32 activations."""
    raw, _ = _blocks(kind, 8, 256)
    top, integer = gguf_blocks.INT8_MAX_ROWS[kind], "int16" if kind.endswith("_K") else "int8"
    for rows, path in ((1, integer), (top, integer), (top + 1, "fp32")):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(gguf_blocks.linear(kind, x.bfloat16(), raw),
                           gguf_blocks.linear(kind, x.bfloat16(), raw, path=path))
        assert torch.equal(gguf_blocks.linear(kind, x, raw), gguf_blocks.linear(kind, x, raw, path="fp32"))


@pytest.mark.parametrize("up,down", [("Q8_0", "Q8_0"), ("Q4_K", "Q6_K"), ("Q5_K", "Q4_0"), ("MXFP4", "MXFP4")])
def test_one_tokens_experts_in_one_call_on_int8(up, down):
    """The fused one-token call: x quantized, each expert's silu(gate) · up quantized again before the down rows
    (each for its matrix's format: int16 a 256 for the K-quants, int8 a 32 for the others)."""
    E, D, I = 4, 256, 512
    w13 = [_blocks(up, 2 * I, D, seed=e) for e in range(E)]
    w2 = [_blocks(down, D, I, seed=10 + e) for e in range(E)]
    g = torch.Generator().manual_seed(2)
    x, ids, wts = torch.randn(1, D, generator=g), torch.tensor([[3, 1]]), torch.tensor([[0.7, 0.3]])
    args = (x, ids, wts, (up, torch.stack([r for r, _ in w13])), (down, torch.stack([r for r, _ in w2])))
    got = gguf_blocks.moe(*args, path="int8")
    want = torch.zeros(1, D, dtype=torch.float64)
    for e, w in zip(ids[0].tolist(), wts[0].tolist()):
        gate, u = _reference(x, w13[e][1], _group(up)).float().chunk(2, -1)  # the kernel keeps gate/up in float32
        h = torch.nn.functional.silu(gate) * u
        want += w * _reference(h, w2[e][1], _group(down))
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
