"""The expert kernel's AMX tiles (core/assets/kernels/moe_ffn.c, built with -mamx-tile where the usable ISA is AMX).

Where the CPU and OS give AMX: experts with 8 rows or more run on 16-row tiles, fewer on the vector tiles, in
the same call; every row count around the tile's 16 (a partial block reads padding it never uses) and K in
several tile blocks matches float64 as closely as the vector tiles, and the two paths agree to an fp32 sum's
order; the dense projections on the same panels too. Everywhere: a usable ISA below AMX (AVX-512 BF16, also
under ONEDNN_MAX_CPU_ISA) or `MLIGHT_NATIVE_AMX=0` builds no tiles, and a CPU whose OS refuses the tile state
keeps the vector tiles even when asked for AMX (faked where the hardware lacks it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.model.cpu import ffn, isa, panel_linear
from test_cpu_ffn_kernel import _rel, fresh_build  # noqa: F401 (a fixture)

_lib = ffn.library()
tiles = pytest.mark.skipif(_lib is None or not _lib.amx,
                           reason=f"no AMX tiles here ({isa.cpu_isa().label}; {ffn.status()})")
vector = pytest.mark.skipif(_lib is None, reason=f"the expert kernel does not run here: {ffn.status()}")


def _reference(h, w13, w2, weights, idx):
    I = w2.shape[-1]
    out = torch.zeros(h.shape[0], w2.shape[1], dtype=torch.float64)
    gu = torch.einsum("eid,td->tei", w13.double(), h.double())  # [T, E, 2I]
    act = F.silu(gu[..., :I]) * gu[..., I:]
    y = torch.einsum("edi,tei->ted", w2.double(), act)  # [T, E, D]
    for j in range(idx.shape[1]):
        out += weights[:, j, None].double() * y[torch.arange(h.shape[0]), idx[:, j]]
    return out


def _case(n, E=4, D=1152, I=1056, seed=0):
    """Expert 0 takes all n tokens in slot 0; slot 1 spreads them over experts 1..E-1 (some under 8 rows).
    D = 1152: 576 K pairs, tile blocks of 512 + 64; I = 1056: 528, 512 + 16."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, D, generator=g) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, D, I, generator=g) / I ** 0.5).bfloat16()
    h = torch.randn(n, D, generator=g).bfloat16()
    idx = torch.stack([torch.zeros(n, dtype=torch.int64), 1 + torch.arange(n) % (E - 1)], 1)
    w = torch.rand(n, 2, generator=g).bfloat16()
    return w13, w2, h, w, idx


@tiles
@pytest.mark.parametrize("n", [8, 15, 16, 17, 31, 33, 50])
def test_tiles_match_float64_at_row_counts_around_a_tile(n):
    w13, w2, h, w, idx = _case(n)
    got = ffn.NativeExperts(w13, w2)(h, w, idx)
    assert _rel(got, _reference(h, w13, w2, w, idx)) < 6e-3


@tiles
def test_tiles_and_vector_tiles_agree(monkeypatch, fresh_build):
    """The same call on both builds: equal but for an fp32 sum's order (which moves a rounding of the bf16
    intermediate or the output now and then: 0.25 % of the outputs, 1.4e-3 of the largest, here)."""
    w13, w2, h, w, idx = _case(40, E=6, seed=3)
    nat = ffn.NativeExperts(w13, w2)
    assert ffn.library().amx
    on = nat(h, w, idx)
    monkeypatch.setenv("MLIGHT_NATIVE_AMX", "0")
    ffn.KERNEL.cache_clear()
    assert not ffn.library().amx and "-mamx" not in ffn.library().flags
    off = nat(h, w, idx)
    assert (on == off).float().mean().item() >= 0.99
    assert ((on.float() - off.float()).abs().max() / on.float().abs().max()).item() < 3e-3


@tiles
@pytest.mark.parametrize("T, K, N", [(8, 1152, 128), (37, 640, 192), (520, 64, 64)])
def test_dense_projections_on_tiles_give_linear(T, K, N):
    """K = 1152: tile blocks of 512 + 64 K pairs; T = 520: a chunk of 512 and one of 8, both on tiles; rows of x
    3K/2 apart (a wider payload's slice)."""
    g = torch.Generator().manual_seed(T)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).bfloat16()
    wide = torch.randn(T, K + K // 2, generator=g).bfloat16()
    x = wide[:, K // 2:]
    got = F.linear(x, panel_linear.PanelWeight(w))
    want = F.linear(x.contiguous(), w)
    ref = F.linear(x.double(), w.double())
    assert (got == want).float().mean().item() >= 0.999
    assert _rel(got, ref) <= max(4e-3, 1.01 * _rel(want, ref))


@vector
def test_below_amx_or_switched_off_no_tiles(monkeypatch, fresh_build):
    """The usable ISA AVX-512 BF16 (a CPU without AMX, or ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16): no AMX flags."""
    lib = ffn.KERNEL.at("avx512_bf16")
    assert lib is not None and not lib.amx and "-mamx" not in lib.flags
    monkeypatch.setenv("MLIGHT_NATIVE_AMX", "0")
    lib = ffn.KERNEL.at("amx")
    assert lib is not None and not lib.amx and "-mamx" not in lib.flags


@vector
def test_an_os_or_cpu_that_refuses_the_tile_state_keeps_the_vector_tiles(monkeypatch, fresh_build):
    """Asked for AMX where the hardware lacks it (faked: the usable level said to be AMX), the library is
    built with the tile path but the OS grants no tile state, so it never runs: the results stay right."""
    if isa.cpu_isa().hardware == "amx":
        pytest.skip("this CPU has AMX: the refusal cannot be shown here")
    lib = ffn.KERNEL.at("amx")
    assert lib is not None and not lib.amx
    monkeypatch.setattr(ffn, "library", lambda: lib)
    w13, w2, h, w, idx = _case(20, D=128, I=96)
    assert _rel(ffn.NativeExperts(w13, w2)(h, w, idx), _reference(h, w13, w2, w, idx)) < 6e-3
