"""A few tokens' GGUF experts and dense rows with Q8_0, Q4_K, Q5_K and Q6_K rows dotted in place
(core.model.cpu.gguf_token). Q8_0, and the K-quants where their rows are decoded first (AVX2, plain C), against
gguf_blocks' default path: equal bit for bit (the same integers, products and lane order). The K-quants on AVX-512
VNNI take their own int8 activations (a scale a 256 and a power of two a 32: `pow2_reading`): the float32 result
against the float64 dot of those activations with the file's weights, within float32's rounding. Either way:
block counts that end a 16-block scale group early or leave an odd block, row counts that leave a partial tile
of rows, 1-9 activation rows through a matrix, 1, 2 or 8 experts, random bytes no quantizer writes, and every
token of a batch equal to the same token alone bit for bit. Under tests/test_cpu_avx2_lane.py the same file
checks the AVX2 build, where the K-quants' rows are decoded first."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from core.model.cpu import gguf_blocks, gguf_token
from test_gguf_int8 import K_QUANTS, _group, _reference, quantized
from test_gguf_native import _blocks

pytestmark = pytest.mark.skipif(gguf_blocks.library() is None, reason="no C compiler: GGUF blocks expand per use")
# the K-quants dotted where they lie, on their own int8 activations (AVX-512 VNNI); elsewhere decoded first
POW2 = gguf_blocks.library() is not None and gguf_token.library().simd == gguf_blocks.SIMD[2]
KS = 64  # gguf_token.c's KS: a 32's step is k D, k = 1..KS


def pow2_reading(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the K-quants' VNNI dots read it, in float64: a super-block of 256 takes D = A / 127 / KS (A its
    max|x|), each 32 of it the step k D with k = ceil(KS max|x of the 32| / A) in 1..KS, and q = round(x / (k D))
    half to even, all in float32; x reads q k D."""
    b = x.float().reshape(x.shape[0], -1, 8, 32)
    am = b.abs().amax(-1)
    A = am.amax(-1, keepdim=True)
    D = torch.div(torch.div(A, torch.tensor(127.0)), torch.tensor(float(KS)))
    k = torch.where(A > 0, torch.ceil(torch.div(am * KS, A)), torch.ones_like(am)).clamp(1, KS)
    step = D * k
    inv = torch.where(step > 0, torch.div(torch.ones_like(step), step), torch.zeros_like(step))
    q = torch.round(b * inv[..., None]).clamp(-127, 127)
    return (q.double() * step.double()[..., None]).reshape(x.shape)


def reading(kind: str, x: torch.Tensor) -> torch.Tensor:
    """x as this kernel's default path reads it for a `kind` matrix, float64."""
    if kind in K_QUANTS:
        return pow2_reading(x) if POW2 else quantized(x, 256, 16383)
    return quantized(x, _group(kind))


def _dequantized(kind: str, raw: torch.Tensor, K: int) -> torch.Tensor:
    """gguf's float reading of any bytes in `kind` [N, bytes] -> [N, K]"""
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[kind]),
                                     dtype=np.float32)).reshape(-1, K)


def _parts(kind: str, raw: torch.Tensor, K: int) -> torch.Tensor:
    """|d sc u| + |dmin m| of each weight (Q6_K: |d sc u| + |32 d sc|), bounded through gguf's reading of the
    bytes with a field zeroed: the two integer parts a K-quant dot sums apart, whose float roundings count."""
    b = raw.view(raw.shape[0], -1, {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind])
    if kind == "Q6_K":  # every quant 0: -32 d sc
        z = b.clone()
        z[..., :192] = 0
        d32 = _dequantized(kind, z.reshape(raw.shape), K).abs()
        return _dequantized(kind, raw, K).abs() + 2 * d32
    no_min, no_d = b.clone(), b.clone()
    no_min[..., 2:4], no_d[..., 0:2] = 0, 0
    return _dequantized(kind, no_min.reshape(raw.shape), K).abs() + _dequantized(kind, no_d.reshape(raw.shape), K).abs()


def _close(got: torch.Tensor, x: torch.Tensor, raw: torch.Tensor, kind: str, out_bf16: bool):
    """got [M, N] against reading(kind, x) @ deq^T in float64: float32's roundings of each super-block's integer
    parts and of the sums over K / 256 super-blocks and 8 lanes (and bf16's of the result)."""
    K = x.shape[1]
    r = reading(kind, x)
    want = r @ _dequantized(kind, raw, K).double().t()
    mag = r.abs() @ _parts(kind, raw, K).double().t()
    err = (got.double() - want).abs() - (2 ** -8 * want.abs() if out_bf16 else 0)
    assert (err <= 2 ** -22 * (K / 256 + 8) * mag + 1e-30).all(), (err / mag).max().item()


def test_it_builds_wherever_gguf_blocks_does():
    """gguf_matmul.c is compiled into it: a change there that breaks this build fails here, not in a silent fallback."""
    assert gguf_token.library() is not None, gguf_token.status()


def _experts(up: str, down: str, E: int, D: int, I: int):
    w13 = [_blocks(up, 2 * I, D, seed=e) for e in range(E)]
    w2 = [_blocks(down, D, I, seed=10 + e) for e in range(E)]
    return w13, w2, (up, torch.stack([r for r, _ in w13])), (down, torch.stack([r for r, _ in w2]))


# D, I: 1, 3 and 17 blocks of 32 (a lone block, an odd tail, a second scale group of one); 32 and 40 blocks
@pytest.mark.parametrize("up,down,D,I", [("Q8_0", "Q8_0", 32, 96), ("Q8_0", "Q8_0", 544, 1024),
                                         ("Q8_0", "Q8_0", 1024, 1280), ("Q8_0", "Q6_K", 544, 512),
                                         ("Q4_K", "Q8_0", 512, 544)])
def test_in_place_q8_0_rows_equal_the_decoded_rows(up, down, D, I):
    E = 4
    w13, w2, up_raw, down_raw = _experts(up, down, E, D, I)
    g = torch.Generator().manual_seed(D + I)
    x = torch.randn(1, D, generator=g).bfloat16()
    ids = torch.tensor([[3, 0, 2]])
    for wts in (torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.5, 0.3, 0.2]]).bfloat16()):
        got = gguf_token.moe(x, ids, wts, up_raw, down_raw)
        if not (POW2 and {up, down} & set(K_QUANTS)):
            assert torch.equal(got, gguf_blocks.moe(x, ids, wts, up_raw, down_raw))
        assert torch.equal(gguf_token.moe(x, ids, wts, up_raw, down_raw, path="int8_c"),
                           gguf_blocks.moe(x, ids, wts, up_raw, down_raw, path="int8_c"))
    want = torch.zeros(1, D, dtype=torch.float64)
    for e, w in zip(ids[0].tolist(), wts.float()[0].tolist()):
        gate, u = (reading(up, x) @ w13[e][1].double().t()).float().chunk(2, -1)
        want += w * (reading(down, torch.nn.functional.silu(gate) * u) @ w2[e][1].double().t())
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())  # bf16 out


def test_any_bytes_and_scales_equal_the_decoded_rows():
    """Blocks no quantizer writes (bytes of -128, scales from 1e-3 to 60): the sign trick and the scale products."""
    g = torch.Generator().manual_seed(7)
    E, D, I = 3, 96, 160

    def raw(n, k):
        r = torch.randint(-128, 128, (E, n, k // 32, 34), generator=g).to(torch.int8).view(torch.uint8)
        scales = (torch.rand(E, n, k // 32, generator=g) * 60 + 1e-3).half()
        r[..., :2] = scales.view(torch.uint8).view(E, n, k // 32, 2)
        return r.reshape(E, n, -1)

    up, down = ("Q8_0", raw(2 * I, D)), ("Q8_0", raw(D, I))
    x, ids, wts = torch.randn(1, D, generator=g).bfloat16(), torch.tensor([[2, 1]]), torch.tensor([[0.75, 0.25]])
    assert torch.equal(gguf_token.moe(x, ids, wts, up, down), gguf_blocks.moe(x, ids, wts, up, down))


def test_calls_it_does_not_take_fall_back():
    """fp32 tokens (the float32 engine's fp32 path), more (token, expert) pairs than MAX_SLOTS, and calls with
    neither a Q8_0 nor a K-quant matrix stay with gguf_blocks.moe."""
    _, _, up, down = _experts("Q8_0", "Q8_0", 2, 64, 64)
    _, _, up_0, down_0 = _experts("Q4_0", "MXFP4", 2, 64, 64)
    ids, wts = torch.tensor([[1, 0]]), torch.tensor([[0.5, 0.5]])
    assert gguf_token.moe(torch.randn(1, 64), ids, wts, up, down) is None
    assert gguf_token.moe(torch.randn(1, 64).bfloat16(), ids, wts, up_0, down_0) is None
    M = gguf_token.MAX_SLOTS // 2
    assert gguf_token.moe(torch.randn(M, 64).bfloat16(), ids.repeat(M, 1), wts.repeat(M, 1), up, down) is not None
    assert gguf_token.moe(torch.randn(M + 1, 64).bfloat16(), ids.repeat(M + 1, 1), wts.repeat(M + 1, 1), up,
                          down) is None


# a small batch's decode: tokens sharing experts (one expert by every token, one by one token only, one twice
# by the same token), Q8_0 beside the K-quants, and a lone token
@pytest.mark.parametrize("up,down,D,I", [("Q4_K", "Q6_K", 768, 512), ("Q5_K", "Q4_K", 512, 768),
                                         ("Q8_0", "Q6_K", 544, 512), ("Q4_K", "Q8_0", 512, 544)])
def test_tokens_of_a_batch_equal_each_token_alone(up, down, D, I):
    """One call for M tokens reads each expert once for all the tokens routed to it; each token's row is that
    token alone through the kernel bit for bit, SIMD and plain C (and so through gguf_blocks.moe where the two
    read the activations alike)."""
    E, g = 6, torch.Generator().manual_seed(D + I)
    _, _, up_raw, down_raw = _experts(up, down, E, D, I)
    ids = torch.tensor([[0, 3], [3, 1], [3, 3], [5, 3], [2, 3], [3, 0], [4, 1]])
    for M in (1, 2, 7):
        x = torch.randn(M, D, generator=g).bfloat16()
        wts = torch.softmax(torch.randn(M, 2, generator=g), -1)
        for path in ("int8", "int8_c"):
            got = gguf_token.moe(x, ids[:M], wts, up_raw, down_raw, path=path)
            for m in range(M):
                alone = gguf_token.moe(x[m:m + 1], ids[m:m + 1], wts[m:m + 1], up_raw, down_raw, path=path)
                assert torch.equal(got[m:m + 1], alone), (M, m, path)
                if path == "int8_c" or not (POW2 and {up, down} & set(K_QUANTS)):
                    blocks = gguf_blocks.moe(x[m:m + 1], ids[m:m + 1], wts[m:m + 1], up_raw, down_raw, path=path)
                    assert torch.equal(alone, blocks), (M, m, path)


# D, I: 1, 3 and 5 super-blocks (K not a multiple of 512); gate/up rows 2I and down rows D leave no partial tile
# of 4 rows here, the linear test below does; experts: 1, 2 and all 8
@pytest.mark.parametrize("up,down,D,I", [("Q4_K", "Q4_K", 1280, 768), ("Q4_K", "Q6_K", 768, 1280),
                                         ("Q5_K", "Q5_K", 256, 768), ("Q6_K", "Q4_K", 768, 256),
                                         ("Q4_K", "Q8_0", 512, 544), ("Q8_0", "Q6_K", 544, 512)])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_in_place_k_quant_rows_equal_their_reading(up, down, D, I, k):
    """The experts' call: the reference of the activations as read (`reading`) within bf16's rounding of the
    hidden and output rows; gguf_blocks' result bit for bit where it reads them alike, and the plain-C dots."""
    E = 8
    w13, w2, up_raw, down_raw = _experts(up, down, E, D, I)
    g = torch.Generator().manual_seed(D + I + k)
    x = torch.randn(1, D, generator=g).bfloat16()
    ids = torch.randperm(E, generator=g)[:k].unsqueeze(0)
    wts = torch.softmax(torch.randn(1, k, generator=g), -1)
    got = gguf_token.moe(x, ids, wts, up_raw, down_raw)
    if not POW2:
        assert torch.equal(got, gguf_blocks.moe(x, ids, wts, up_raw, down_raw))
    plain = gguf_token.moe(x, ids, wts, up_raw, down_raw, path="int8_c")
    assert torch.equal(plain, gguf_blocks.moe(x, ids, wts, up_raw, down_raw, path="int8_c"))
    if "Q8_0" not in (up, down) and not POW2:  # the K-quants' SIMD and plain-C dots: the same integers, FMAs, lanes
        assert torch.equal(got, plain)
    want = torch.zeros(1, D, dtype=torch.float64)
    for e, w in zip(ids[0].tolist(), wts[0].tolist()):
        gate, u = (reading(up, x) @ w13[e][1].double().t()).float().chunk(2, -1)
        want += w * (reading(down, torch.nn.functional.silu(gate) * u) @ w2[e][1].double().t())
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())  # bf16 out


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("K,N", [(256, 1), (768, 6), (1280, 45), (1024, 4)])
def test_one_row_through_a_k_quant_matrix_equals_gguf_blocks(kind, K, N):
    """`linear` for the K-quants: N rows leave 1, 2, 3 or no rows past the last whole tile of 4; written into a
    column slice of a wider output; the reading's reference, and gguf_blocks' result where it reads alike; the
    plain-C dots equal to gguf_blocks'."""
    raw, deq = _blocks(kind, N, K, seed=K + N)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(K)).bfloat16()
    want = gguf_blocks.linear(kind, x, raw)
    wide = torch.zeros(1, N + 16, dtype=torch.bfloat16)
    assert gguf_token.linear(kind, x, raw, wide[:, 8:8 + N])
    assert not wide[:, :8].any() and not wide[:, 8 + N:].any()
    _close(wide[:, 8:8 + N], x, raw, kind, out_bf16=True)
    assert POW2 or torch.equal(wide[:, 8:8 + N], want)
    c = torch.empty(1, N, dtype=torch.bfloat16)
    assert gguf_token.linear(kind, x, raw, c, path="int16_c")
    assert torch.equal(c, gguf_blocks.linear(kind, x, raw, path="int16_c")) and torch.equal(c, want)
    torch.testing.assert_close(want.double(), _reference(x.float(), deq, 256, 16383), rtol=1e-2, atol=1e-2)
    assert not gguf_token.linear(kind, x, raw, c, path="int8")  # not this format's integer path
    assert not gguf_token.linear(kind, x.float(), raw, c.float())


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("K,N", [(256, 1), (768, 7), (1280, 45)])
def test_a_few_rows_through_a_k_quant_matrix_equal_gguf_blocks(kind, K, N):
    """`linear` at M = 1..ROWS + 1 activation rows (an expert's rows at a small batch's decode): K an odd count of
    super-blocks, N leaving a lone weight row past the last pair; rows written ldy apart into a wider output;
    the SIMD and plain-C dots equal to each other and to gguf_blocks' at the same M. With AVX2 the rows past
    the first stay with gguf_blocks (False, nothing written); past ROWS every build declines. On VNNI each row is
    the reading's reference, and the same row alone bit for bit."""
    raw, deq = _blocks(kind, N, K, seed=K + N)
    g = torch.Generator().manual_seed(K + N)
    in_place = gguf_token.library().simd == gguf_blocks.SIMD[2]
    for M in range(1, gguf_token.ROWS + 2):
        x = torch.randn(M, K, generator=g).bfloat16()
        want = gguf_blocks.linear(kind, x, raw)
        wide = torch.zeros(M, N + 16, dtype=torch.bfloat16)
        took = gguf_token.linear(kind, x, raw, wide[:, 8:8 + N])
        assert took == (M == 1 or (M <= gguf_token.ROWS and in_place))
        if took and POW2:
            _close(wide[:, 8:8 + N], x, raw, kind, out_bf16=True)
            for m in range(M):
                alone = torch.empty(1, N, dtype=torch.bfloat16)
                assert gguf_token.linear(kind, x[m:m + 1], raw, alone) and torch.equal(alone, wide[m:m + 1, 8:8 + N])
        elif took:
            assert torch.equal(wide[:, 8:8 + N], want)
        assert not wide[:, :8].any() and not wide[:, 8 + N:].any() and (took or not wide.any())
        c = torch.zeros(M, N, dtype=torch.bfloat16)
        assert gguf_token.linear(kind, x, raw, c, path="int16_c") == (M <= gguf_token.ROWS)
        if M <= gguf_token.ROWS:
            assert torch.equal(c, gguf_blocks.linear(kind, x, raw, path="int16_c")) and torch.equal(c, want)
            assert POW2 or not took or torch.equal(c, wide[:, 8:8 + N])
        torch.testing.assert_close(want.double(), _reference(x.float(), deq, 256, 16383), rtol=1e-2, atol=1e-2)
    q8, _ = _blocks("Q8_0", 4, 64)  # Q8_0 at two rows: gguf_blocks' tiles
    assert not gguf_token.linear("Q8_0", torch.randn(2, 64).bfloat16(), q8, torch.empty(2, 4, dtype=torch.bfloat16))


def test_any_k_quant_bytes_and_scales_equal_gguf_blocks():
    """Blocks no quantizer writes (every byte random: 6-bit scales and mins up to 63, Q6_K's scales -128..127,
    half scales anywhere in 2^-4..2^2): the in-place unpacking of scales, mins and quants."""
    g = torch.Generator().manual_seed(11)
    E, D, I = 3, 512, 768
    tsz = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}

    def raw(kind, n, k):
        r = torch.randint(0, 256, (E, n, k // 256, tsz[kind]), generator=g, dtype=torch.uint8)
        nh, at = (1, 208) if kind == "Q6_K" else (2, 0)  # Q6_K's d at its end; d and dmin first
        halves = (torch.rand(E, n, k // 256, nh, generator=g) * 4 + 2 ** -4).half().view(torch.uint8)
        r[..., at:at + 2 * nh] = halves.reshape(E, n, k // 256, 2 * nh)
        return r.reshape(E, n, -1)

    for up, down in (("Q4_K", "Q6_K"), ("Q5_K", "Q4_K"), ("Q6_K", "Q5_K")):
        u, d = (up, raw(up, 2 * I, D)), (down, raw(down, D, I))
        x, ids, wts = torch.randn(1, D, generator=g).bfloat16(), torch.tensor([[2, 1]]), torch.tensor([[0.75, 0.25]])
        got = gguf_token.moe(x, ids, wts, u, d)
        assert not got.isnan().any() and (POW2 or torch.equal(got, gguf_blocks.moe(x, ids, wts, u, d)))
        y, h = torch.empty(1, D, dtype=torch.bfloat16), torch.randn(1, I, generator=g).bfloat16()
        assert gguf_token.linear(down, h, d[1][0], y)
        if POW2:
            _close(y, h, d[1][0], down, out_bf16=True)
        else:
            assert torch.equal(y, gguf_blocks.linear(down, h, d[1][0]))


@pytest.mark.parametrize("K", [32, 96, 544, 1024])
def test_one_row_through_a_q8_0_matrix_equals_the_decoded_rows(K):
    """`linear`: a decode step's dense projection at batch 1, written into a column slice of a wider output."""
    raw, deq = _blocks("Q8_0", 48, K, seed=K)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(K)).bfloat16()
    want = gguf_blocks.linear("Q8_0", x, raw)
    wide = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert gguf_token.linear("Q8_0", x, raw, wide[:, 8:56])
    assert torch.equal(wide[:, 8:56], want) and not wide[:, :8].any() and not wide[:, 56:].any()
    c = torch.empty(1, 48, dtype=torch.bfloat16)
    assert gguf_token.linear("Q8_0", x, raw, c, path="int8_c")
    assert torch.equal(c, gguf_blocks.linear("Q8_0", x, raw, path="int8_c"))
    torch.testing.assert_close(want.double(), _reference(x.float(), deq), rtol=1e-2, atol=1e-2)
    assert not gguf_token.linear("Q8_0", x.float(), raw, c.float())  # fp32 rows: gguf_blocks' fp32 path
    assert not gguf_token.linear("Q8_0", x.repeat(2, 1), raw, c.repeat(2, 1))


def _fp32_rows(lib, call: str, kind: str, x: torch.Tensor, raw: torch.Tensor, path: int) -> torch.Tensor:
    """`lib`'s linear call with float32 output (the bf16 output of `linear` would hide a one-ulp difference in
    the float lanes): x [M, K] bf16 through raw [N, bytes] on integer path `path` of that library's numbering."""
    M, K = x.shape
    threads = 1
    y = torch.full((M, raw.shape[0]), float("nan"))
    s = torch.empty(getattr(lib, call + "_scratch")(M, K, threads) if call else lib.scratch(M, K, threads))
    fn = getattr(lib, call) if call else lib.linear
    assert fn(gguf_blocks.KINDS[kind], x.data_ptr(), 1, x.stride(0), M, K, raw.data_ptr(), raw.stride(0),
              raw.shape[0], y.data_ptr(), 0, y.stride(0), s.data_ptr(), threads, path) == 0
    return y


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("K,N", [(256, 3), (768, 9), (1280, 6)])
def test_k_quant_rows_equal_gguf_blocks_in_float32(kind, K, N):
    """The float32 results themselves, before any bf16 rounding, at M = 1..9 activation rows (the one-row dots,
    the few-row tiles and a tile and a row past 8), K an odd count of super-blocks, N a partial tile of weight
    rows: the plain-C dots and gguf_blocks' int16 path bit for bit, and the SIMD dots too where they read the
    activations alike; on VNNI the SIMD dots against their reading's float64 reference, with activations at the
    integers' extremes (every 32 at 127 on the largest scale, the most a lane sums) and 32s far below their
    super-block's largest; random bytes (every scale, min and quant a quantizer may not write) as well as
    quantized weights."""
    g = torch.Generator().manual_seed(K + N)
    tsz = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
    rnd = torch.randint(0, 256, (N, K // 256, tsz[kind]), generator=g, dtype=torch.uint8)
    nh, at = (1, 208) if kind == "Q6_K" else (2, 0)
    rnd[..., at:at + 2 * nh] = (torch.rand(N, K // 256, nh, generator=g) * 4 + 2 ** -4).half().view(torch.uint8)
    tok, blk = gguf_token.library(), gguf_blocks.library()
    for raw in (_blocks(kind, N, K, seed=K + N)[0], rnd.reshape(N, -1)):
        for M in range(1, 10):
            x = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 8).bfloat16()
            x[0, :7] = 0  # a zero run and, below, an activation at the quantizer's ends
            x[-1, 5] = x[-1].abs().max() * (-1) ** M
            if M in (2, 5):  # every value at a super-block's largest, alternating signs by weight row sign
                x[1] = torch.where(torch.arange(K) % 3 == 0, -1.0, 1.0).bfloat16() * 3
            if M in (3, 6):  # 32s 2^-3 .. 2^-9 of their super-block's largest
                x[2] *= (2.0 ** -torch.arange(K).div(32, rounding_mode="floor").remainder(8).add(2)).bfloat16()
            want = _fp32_rows(blk, "", kind, x, raw, gguf_blocks.PATHS["int16"])
            assert not want.isnan().any()
            simd = _fp32_rows(tok, "linear", kind, x, raw, 2)
            if POW2:
                _close(simd, x, raw, kind, out_bf16=False)
                for m in range(M):
                    assert torch.equal(_fp32_rows(tok, "linear", kind, x[m:m + 1], raw, 2), simd[m:m + 1]), (M, m)
            else:
                assert torch.equal(simd, want), (M, "SIMD")
            assert torch.equal(_fp32_rows(tok, "linear", kind, x, raw, 1), want), (M, "plain C")
            assert torch.equal(_fp32_rows(blk, "", kind, x, raw, gguf_blocks.PATHS["int16_c"]), want), (M, "C")
