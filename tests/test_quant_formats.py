"""int8 / int4 formats against float64 references; CPU kernels and the dequantize backend against each other."""

from __future__ import annotations

import pytest
import torch

from core.errors import UsageError
from core.model.moe import experts
from core.model.quant.experts import ExpertScheme, QuantExperts
from core.model.quant.formats import Format, dequantize, fit_group, parse_choice, quantize
from test_moe import reference


def _w(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    w[3] *= 40  # an outlier row: per-channel / per-group scales must not let it spoil the others
    return w


def test_int8_rounds_each_weight_to_its_channel_grid():
    w = _w(64, 96)
    parts = quantize(Format("int8"), w)
    assert parts["q"].dtype == torch.int8 and parts["scale"].shape == (64,)
    scale = w.abs().amax(-1) / 127
    torch.testing.assert_close(parts["scale"].double(), scale, rtol=1e-6, atol=0)
    err = (dequantize(Format("int8"), parts).double() - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()  # round to nearest on the channel's grid
    assert (parts["q"].abs().amax(-1) == 127).all()  # the largest weight of each row uses the full range


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_group_error_is_half_a_step(group):
    w = _w(48, 256, seed=group)
    fmt = Format("int4", group)
    parts = quantize(fmt, w)
    assert parts["q"].shape == (48, 128) and parts["q"].dtype == torch.uint8
    assert parts["sz"].shape == (48, 256 // group, 2) and parts["sz"].dtype == torch.bfloat16
    deq = dequantize(fmt, parts).double()
    wg = w.reshape(48, -1, group)
    step = ((wg.amax(-1) - wg.amin(-1)) / 15).repeat_interleave(group, -1)
    # half a step of the stored grid, plus what rounding the scale and zero to bf16 moved it (≤ 2^-8 each)
    assert ((deq - w).abs() <= step * (0.5 + 8 * 2**-8 + 2**-7) + 1e-6).all()
    nib = torch.stack([parts["q"] & 15, parts["q"] >> 4], -1).reshape(48, 256).double()
    sz = parts["sz"].double().repeat_interleave(group, 1)
    torch.testing.assert_close(deq, (nib - 8) * sz[..., 0] + sz[..., 1], rtol=0, atol=0)  # low nibble = even k


def test_format_sizes_and_choices():
    def bits(fmt, n, k):
        return 8 * fmt.nbytes(n, k) / (n * k)

    assert bits(Format("int8"), 4096, 14336) == pytest.approx(8 + 32 / 14336)
    assert bits(Format("int4", 32), 4096, 4096) == pytest.approx(5.0)  # bf16 scale + zero per group
    assert bits(Format("int4", 128), 4096, 4096) == pytest.approx(4.25)
    assert bits(Format("Q4_K"), 16, 4096) == pytest.approx(4.5)
    assert bits(Format("Q6_K"), 16, 4096) == pytest.approx(6.5625)
    assert parse_choice("none") is None and parse_choice("int4", 32) == Format("int4", 32)
    assert fit_group(Format("int4", 128), 2880, 2880) == Format("int4", 64)  # gpt-oss sizes
    with pytest.raises(UsageError, match="group size 16"):
        Format("int4", 16)
    with pytest.raises(UsageError, match="multiples of 32"):
        fit_group(Format("int4", 64), 64, 48)
    with pytest.raises(UsageError, match="unknown --quantize"):
        parse_choice("int3")


def _stack(fmt, E, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, n, k, generator=g) / k**0.5
    return quantize(fmt, w)


@pytest.mark.parametrize("fmt", [Format("int8"), Format("int4", 32), Format("int4", 64)], ids=lambda f: f.label)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,k,D,I", [(1, 4, 2, 64, 64), (9, 8, 2, 128, 96), (40, 4, 2, 64, 128)])
def test_quantized_experts_match_the_float64_moe(fmt, dtype, T, E, k, D, I):
    """Kernel backend, dequantize backend and the float64 MoE over the dequantized weights agree."""
    if fmt.name == "int4" and (D % fmt.group or I % fmt.group):
        pytest.skip("group does not divide")
    scheme = ExpertScheme.uniform(fmt, D, I)
    p13, p2 = _stack(fmt, E, 2 * I, D, 1), _stack(fmt, E, D, I, 2)
    parts = {**{f"w13.{s}": t for s, t in p13.items()}, **{f"w2.{s}": t for s, t in p2.items()}}
    g = torch.Generator().manual_seed(T)
    h = torch.randn(T, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    want = reference(h, dequantize(fmt, p13).double(), dequantize(fmt, p2).double(), weights, idx)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    hx, wx = h.to(dtype), weights.to(dtype)
    dq = QuantExperts(scheme, parts, dtype)
    kern = QuantExperts(scheme, parts, dtype)
    assert kern.pack_cpu()
    kern.kernel_rows = 10**9  # every expert through the kernel
    # mlight's C int4 kernel quantizes the activations to ~15 bits (core.model.cpu.int4): in fp32, within
    # 1e-4 of the largest output rather than 1e-5 (in bf16 the output's own rounding is the larger)
    ktol = 1e-4 if kern.native and dtype == torch.float32 else tol
    for q, t in ((dq, tol), (kern, ktol)):
        got = experts(hx, None, None, wx, idx, quant=q)
        torch.testing.assert_close(got.double(), want, rtol=t, atol=t * want.abs().max().item())
    kern.detach_parts()  # the flat buffer gone: large batches still run (int4 expanded, or on torch's kernel)
    kern.kernel_rows = 0
    torch.testing.assert_close(experts(hx, None, None, wx, idx, quant=kern).double(), want, rtol=tol,
                               atol=tol * want.abs().max().item())
