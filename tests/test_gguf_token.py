"""One token's GGUF experts with Q8_0 rows dotted in place (core.model.cpu.gguf_token) against gguf_blocks.moe's
default path, which decodes each row first: equal bit for bit (the same integers, products and lane order), on
the SIMD dots and the plain-C ones, at block counts that end a 16-block scale group early or leave an odd block;
and against the float64 reference of the same arithmetic (test_gguf_int8's)."""

from __future__ import annotations

import pytest
import torch

from core.model.cpu import gguf_blocks, gguf_token
from test_gguf_int8 import _group, _reference
from test_gguf_native import _blocks

pytestmark = pytest.mark.skipif(gguf_blocks.library() is None, reason="no C compiler: GGUF blocks expand per use")


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
        assert torch.equal(got, gguf_blocks.moe(x, ids, wts, up_raw, down_raw))
        assert torch.equal(gguf_token.moe(x, ids, wts, up_raw, down_raw, path="int8_c"),
                           gguf_blocks.moe(x, ids, wts, up_raw, down_raw, path="int8_c"))
    want = torch.zeros(1, D, dtype=torch.float64)
    for e, w in zip(ids[0].tolist(), wts.float()[0].tolist()):
        gate, u = _reference(x.float(), w13[e][1], _group(up)).float().chunk(2, -1)
        want += w * _reference(torch.nn.functional.silu(gate) * u, w2[e][1], _group(down))
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
    """fp32 tokens (the float32 engine's fp32 path) and calls without a Q8_0 matrix stay with gguf_blocks.moe."""
    _, _, up, down = _experts("Q8_0", "Q8_0", 2, 64, 64)
    _, _, up_k, down_k = _experts("Q4_K", "Q6_K", 2, 256, 256)
    ids, wts = torch.tensor([[1, 0]]), torch.tensor([[0.5, 0.5]])
    assert gguf_token.moe(torch.randn(1, 64), ids, wts, up, down) is None
    assert gguf_token.moe(torch.randn(1, 256).bfloat16(), ids, wts, up_k, down_k) is None
    assert gguf_token.moe(torch.randn(2, 64).bfloat16(), ids.repeat(2, 1), wts.repeat(2, 1), up, down) is None


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
