"""Dense bf16 projections on the expert kernel's panels (core.model.cpu.panel_linear): F.linear's numbers
(the fp32 sum rounded once, bias before the rounding) for one row and for chunks of many, strided and
3-D inputs, any thread count; `pack_dense` chooses them only where the kernel runs and the shape fits,
and otherwise keeps oneDNN's packing or the plain weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.model.cpu import ffn, kernels, panel_linear

runs = pytest.mark.skipif(ffn.library() is None, reason=f"the bf16 expert kernel does not run here: {ffn.status()}")


def _bf16_steps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |got - ref| in bf16 steps at |ref| (ref float64)."""
    step = torch.ldexp(torch.ones(ref.shape, dtype=torch.float64), torch.frexp(ref).exponent - 8)
    return ((got.double() - ref).abs() / step).max().item()


@runs
@pytest.mark.parametrize("N, K, T, bias", [(1536, 1024, 1, False), (1024, 1024, 7, True), (256, 130, 1100, True),
                                           (64, 2, 3, False)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_panels_give_linear_rounded_once(N, K, T, bias, threads):
    """As far from float64 as torch's bf16 linear (one rounding of an fp32 sum) and equal to it to the bit
    nearly everywhere (the fp32 sums' order differs); T = 1100 runs in three chunks."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(N + T)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).bfloat16()
        x = torch.randn(T, K, generator=g).bfloat16()
        b = torch.randn(N, generator=g).bfloat16() if bias else None
        pw = kernels.pack_dense(w)
        assert isinstance(pw, panel_linear.PanelWeight) and pw.held_bytes == w.numel() * 2
        got = F.linear(x, pw, b)
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert got.dtype == torch.bfloat16 and got.shape == (T, N)
        torch_bf16 = F.linear(x, w, b)
        assert _bf16_steps(got, ref) <= max(1.0, _bf16_steps(torch_bf16, ref))
        assert (got == torch_bf16).float().mean().item() >= 0.999
    finally:
        torch.set_num_threads(before)


@runs
def test_strided_and_3d_inputs():
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(128, 64, generator=g) / 8).bfloat16()
    pw = panel_linear.PanelWeight(w)
    assert panel_linear.status().startswith("the expert kernel's panels")
    wide = torch.randn(9, 100, generator=g).bfloat16()
    x = wide[:, 10:74]  # rows 100 apart: a slice of a wider payload
    assert torch.equal(F.linear(x, pw), F.linear(x.contiguous(), pw))
    x3 = torch.randn(2, 5, 64, generator=g).bfloat16()
    assert torch.equal(F.linear(x3, pw), F.linear(x3.reshape(10, 64), pw).view(2, 5, 128))
    assert F.linear(torch.empty(0, 64, dtype=torch.bfloat16), pw).shape == (0, 128)
    with pytest.raises(TypeError, match="bf16"):
        F.linear(x.float(), pw)
    with pytest.raises(TypeError, match="only for F.linear"):
        pw.t()


def test_pack_dense_takes_panels_only_where_they_run(monkeypatch):
    """Output features not a multiple of 64 (a router), fp32, or no kernel (an AVX2 CPU, no compiler,
    MLIGHT_NATIVE=0): oneDNN's packing where it takes the weight, else the weight itself; `mlight hw`'s line
    says which."""
    g = torch.Generator().manual_seed(1)
    router = torch.randn(8, 64, generator=g).bfloat16()
    assert not isinstance(kernels.pack_dense(router), panel_linear.PanelWeight)
    assert kernels.pack_dense(router.float()) is not None
    assert not panel_linear.takes(router.float())
    w = torch.randn(128, 64, generator=g).bfloat16()
    monkeypatch.setenv("MLIGHT_NATIVE_DENSE", "0")  # the A/B switch
    assert not isinstance(kernels.pack_dense(w), panel_linear.PanelWeight)
    assert panel_linear.status() == "oneDNN's packed GEMMs (MLIGHT_NATIVE_DENSE=0)"
    monkeypatch.delenv("MLIGHT_NATIVE_DENSE")
    monkeypatch.setattr(ffn, "library", lambda: None)
    assert panel_linear.status().startswith("oneDNN's packed GEMMs (no expert kernel: ")
    assert panel_linear.status("float32") == "torch's fp32 GEMMs (MKL on x86) over weights widened at load"
    got = kernels.pack_dense(w)
    assert not isinstance(got, panel_linear.PanelWeight)
    x = torch.randn(3, 64, generator=g).bfloat16()
    torch.testing.assert_close(F.linear(x, got), F.linear(x, w), rtol=0, atol=0.02)
