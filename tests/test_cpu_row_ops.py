"""The decode step's C row operations (core.model.cpu.row_ops, core/assets/kernels/row_ops.c) against the
torch expressions they replace, in bf16 and in fp32 (an AVX2 CPU's math): the KV cache write (also fp32 rows
narrowed into a bf16 cache), RoPE and the residual add bit for bit, RMSNorm within two bf16 steps / a few fp32 ulps
where its sum of squares adds in another order; and every caller's torch path where they do not apply."""

from __future__ import annotations

import pytest
import torch

from core.model import gqa, kvcache, layers
from core.model.cpu import row_ops
from core.model.rope import Rope, for_spec
from core.model.spec import ModelSpec, RopeSpec

needs_kernel = pytest.mark.skipif(row_ops.library() is None, reason="no C compiler here: the torch path runs")


def _torch_rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 64), (7, 1024), (256, 1024), (1638, 1024), (3, 5, 128)])
def test_rms_norm_rounds_as_torch_does(shape):
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[0])
    x = (torch.randn(shape, generator=g) * 3).bfloat16()
    w = (torch.rand(shape[-1], generator=g) + 0.5).bfloat16()
    ref, got = _torch_rms(x, w, 1e-5), row_ops.rms_norm(x, w, 1e-5)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    ulp = torch.ldexp(torch.ones(ref.shape), torch.frexp(ref.float()).exponent - 8)  # a bf16 step at |ref|
    # the sum of squares in another order moves rsqrt by an fp32 ulp: the normed row by one bf16 step at
    # most, which the weight's product (rounded again) turns into at most two
    assert ((got.float() - ref.float()).abs() / ulp).max().item() <= 2.0
    assert (got == ref).float().mean().item() >= 0.999
    assert torch.equal(layers.rms_norm(x, w, 1e-5), got)  # the model's norm takes this path


@needs_kernel
@needs_kernel
@pytest.mark.parametrize("shape", [(1, 64), (256, 1024), (3, 5, 128), (4, 1001)])
def test_rms_norm_in_fp32_is_torch_to_a_few_ulps(shape):
    g = torch.Generator().manual_seed(shape[-1])
    x, w = torch.randn(shape, generator=g) * 3, torch.rand(shape[-1], generator=g) + 0.5
    ref, got = _torch_rms(x, w, 1e-5), row_ops.rms_norm(x, w, 1e-5)
    assert got.dtype == torch.float32 and torch.allclose(got, ref, rtol=4e-7 * 4, atol=0)
    assert torch.equal(layers.rms_norm(x, w, 1e-5), got)


def test_rms_norm_reads_strided_rows_and_declines_what_it_cannot():
    x = torch.randn(16, 1536, generator=torch.Generator().manual_seed(0)).bfloat16()[:, :1024]  # rows 1536 apart
    w = torch.ones(1024).bfloat16()
    assert torch.equal(row_ops.rms_norm(x, w, 1e-6), _torch_rms(x.contiguous(), w, 1e-6))
    assert row_ops.rms_norm(x.float(), w, 1e-6) is None  # mixed dtypes: torch's ops
    assert row_ops.rms_norm(x.double(), w.double(), 1e-6) is None
    odd = torch.randn(4, 1001).bfloat16()  # a width no vector divides: the C loop's scalar tail
    assert (row_ops.rms_norm(odd, torch.ones(1001).bfloat16(), 1e-6) != _torch_rms(odd, torch.ones(1001).bfloat16(),
                                                                                   1e-6)).sum() <= 4
    assert row_ops.rms_norm(torch.randn(8, 64).bfloat16().t(), torch.ones(8).bfloat16(), 1e-6) is None


def _torch_rope_join(rope, qkv, heads, hd, positions, rest):
    T = qkv.shape[0]
    roped = rope.apply(qkv[:, :heads * hd].view(T, heads, hd), positions)
    return torch.cat((roped.reshape(T, heads * hd), qkv[:, heads * hd:heads * hd + rest]), dim=-1)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hd,heads,kv", [(64, 20, 256), (128, 12, 512), (24, 3, 48)])
def test_rope_join_is_torch_bit_for_bit(hd, heads, kv, dtype):
    g = torch.Generator().manual_seed(hd)
    T = 37
    rope = Rope(RopeSpec(theta=1e6), hd, 4096, dtype)
    qkv = (torch.randn(T, heads * hd + kv + 40, generator=g) * 4).to(dtype)  # + an output gate's columns
    positions = torch.randint(0, 4000, (T,), generator=g)
    cos, sin = rope.tables(positions)
    got = row_ops.rope_join(qkv, heads, hd, cos, sin, kv)
    assert torch.equal(got, _torch_rope_join(rope, qkv, heads, hd, positions, kv))


@needs_kernel
def test_rope_join_declines_partial_and_pair_rotations():
    qkv = torch.randn(4, 6 * 64).bfloat16()
    partial = Rope(RopeSpec(), 32, 64, torch.bfloat16)  # 32 of 64 dims rotate: torch's path
    cos, sin = partial.tables(torch.arange(4))
    assert row_ops.rope_join(qkv, 4, 64, cos, sin, 128) is None
    assert not Rope(RopeSpec(pairs=True), 64, 64, torch.bfloat16).joins_in_c(qkv)
    assert not Rope(RopeSpec(), 64, 64, torch.float32).joins_in_c(qkv)  # tables and heads in other dtypes


@pytest.fixture
def threads(request):
    """torch's thread count for the test (the C loops split their rows over that many), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B, threads", [(6, 1), (6, 2), (40, 2), (37, 3)], indirect=["threads"])
def test_kv_write_puts_each_row_where_index_copy_does(dtype, B, threads):
    """Few rows in one loop; from 64 rows (B = 40 × 4 heads) split over the threads, in runs that do not
    divide evenly at 3."""
    g = torch.Generator().manual_seed(1)
    slots, heads, cap, hd = 48, 4, 33, 64
    store = kvcache.KVStore(slots, heads, hd, cap, dtype)
    store.k.normal_(generator=g), store.v.normal_(generator=g)
    payload = torch.randn(B, 3 * heads * hd + 16, generator=g).to(dtype)  # k and v as slices of one payload
    k = payload[:, :heads * hd].view(B, heads, hd)
    v = payload[:, heads * hd:2 * heads * hd].view(B, heads, hd)
    rows = torch.randperm(slots, generator=g)[:B]
    at = (rows[:, None] * heads * cap + torch.arange(heads)[None, :] * cap
          + torch.randint(0, cap, (B,), generator=g)[:, None]).reshape(-1)
    want_k, want_v = store.k.clone(), store.v.clone()
    want_k.view(-1, hd).index_copy_(0, at, k.reshape(-1, hd))
    want_v.view(-1, hd).index_copy_(0, at, v.reshape(-1, hd))
    assert row_ops.kv_write(store.k, store.v, k, v, at)
    assert torch.equal(store.k, want_k) and torch.equal(store.v, want_v)
    assert not row_ops.kv_write(store.k, store.v, k.to(torch.float16), v.to(torch.float16), at)  # another dtype


@needs_kernel
@pytest.mark.parametrize("B, threads", [(3, 1), (45, 2)], indirect=["threads"])
def test_kv_write_narrows_fp32_rows_into_a_bf16_cache_as_to_does(B, threads):
    g = torch.Generator().manual_seed(4)
    store = kvcache.KVStore(B + 2, 2, 64, 16, torch.bfloat16)
    payload = torch.randn(B, 3 * 128, generator=g) * 100  # fp32: an AVX2 CPU's math
    k, v = payload[:, :128].view(B, 2, 64), payload[:, 128:256].view(B, 2, 64)
    slots = torch.randperm(B + 2, generator=g)[:B]
    at = (slots[:, None] * 2 * 16 + torch.arange(2)[None, :] * 16 + torch.randint(0, 16, (B,), generator=g)[:, None])
    at = at.reshape(-1)
    want_k, want_v = store.k.clone(), store.v.clone()
    want_k.view(-1, 64).index_copy_(0, at, k.reshape(-1, 64).to(torch.bfloat16))
    want_v.view(-1, 64).index_copy_(0, at, v.reshape(-1, 64).to(torch.bfloat16))
    assert row_ops.kv_write(store.k, store.v, k, v, at)
    assert torch.equal(store.k, want_k) and torch.equal(store.v, want_v)


def test_without_the_kernels_every_caller_runs_torch(monkeypatch):
    """No compiler (most Windows machines) or MLIGHT_NATIVE=0: the same results from torch's ops."""
    g = torch.Generator().manual_seed(2)
    spec = ModelSpec(architecture="MixtralForCausalLM", family="mixtral", num_layers=1, hidden_size=256,
                     num_heads=4, num_kv_heads=2, head_dim=64, expert_intermediate=64, num_experts=4, top_k=2,
                     vocab_size=64, max_position=256)
    w = {"qkv": torch.randn(8 * 64, 256, generator=g).bfloat16()}
    h, positions = torch.randn(3, 256, generator=g).bfloat16(), torch.tensor([0, 9, 200])
    rope = for_spec(spec, 256, torch.bfloat16)
    x, nw = (torch.randn(5, 128, generator=g) * 2).bfloat16(), (torch.rand(128, generator=g) + 0.5).bfloat16()
    with_c = gqa.pre(spec, w, h, positions, rope)[0], layers.rms_norm(x, nw, 1e-6)
    monkeypatch.setattr(row_ops, "library", lambda: None)
    assert torch.equal(gqa.pre(spec, w, h, positions, rope)[0], with_c[0])
    assert torch.equal(layers.rms_norm(x, nw, 1e-6), _torch_rms(x, nw, 1e-6))
    assert (layers.rms_norm(x, nw, 1e-6) != with_c[1]).sum() <= x.numel() // 1000 + 1
    store = kvcache.KVStore(3, 2, 64, 8, torch.bfloat16)
    k, v = torch.randn(2, 2, 64, generator=g).bfloat16(), torch.randn(2, 2, 64, generator=g).bfloat16()
    assert not row_ops.kv_write(store.k, store.v, k, v, torch.tensor([0, 8, 17, 25]))


def _spec_router(E: int, k: int, norm: str, scale: float) -> ModelSpec:
    return ModelSpec(architecture="MixtralForCausalLM", family="mixtral", num_layers=1, hidden_size=1000, num_heads=4,
                     num_kv_heads=2, head_dim=64, vocab_size=64, num_experts=E, top_k=k, expert_intermediate=128,
                     router_norm=norm, routed_scale=scale)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("E,k,norm,scale", [(8, 2, "sum", 1.0), (64, 6, "none", 1.0), (60, 4, "sum", 2.5)])
def test_softmax_router_chooses_and_weighs_as_torch_does(dtype, E, k, norm, scale):
    """core.model.routing's softmax router: the same experts wherever the k-th and (k+1)-th probabilities are
    apart by more than their rounding, in the same order, and weights within a unit of their last place."""
    from core.model import routing

    spec = _spec_router(E, k, norm, scale)
    g = torch.Generator().manual_seed(E + k)
    T, D = 200, 1000  # D not a multiple of the vector width: the tail's sum too
    h, w = torch.randn(T, D, generator=g).to(dtype), (torch.randn(E, D, generator=g) / D ** 0.5).to(dtype)
    got_w, got_i = row_ops.softmax_route(h, w, k, norm == "sum", scale)
    ref_w, ref_i = routing.choose(spec, torch.nn.functional.linear(h, w), {}, dtype)
    assert got_w.dtype == dtype and got_i.dtype == torch.int64 and got_i.shape == (T, k)
    # rows whose k + 1 largest probabilities are 1 % apart each: a bf16 logit one step off moves a probability 0.4 %
    p = torch.softmax(torch.nn.functional.linear(h, w).float(), -1).sort(-1, descending=True).values[:, :k + 1]
    clear = (-p.diff(dim=-1) / p[:, 1:]).min(-1).values > 1e-2
    assert clear.float().mean() > 0.3
    assert torch.equal(got_i[clear], ref_i[clear])
    # bf16: a unit in the last place; fp32: the logits' 1000-term sums in another order (~1e-6 of them)
    step = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got_w[clear].float(), ref_w[clear].float(), rtol=step, atol=0)
    from core.model import decoder

    assert decoder._c_route(spec, h[:3], {"router": w}) is not None  # the decode step takes this path
    assert decoder._c_route(spec, h, {"router": w}) is None  # T·E past C_ROUTE_LOGITS: torch's threaded matmul
    assert decoder._c_route(_spec_router(E, k, "pnorm", 1.0), h[:3], {"router": w}) is None


@needs_kernel
def test_softmax_router_declines_what_it_cannot():
    h, w = torch.randn(2, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    assert row_ops.softmax_route(h, w.float(), 2, True, 1.0) is None  # mixed dtypes
    assert row_ops.softmax_route(h, w.t().contiguous().t(), 2, True, 1.0) is None  # a strided router
    assert row_ops.softmax_route(h, torch.randn(600, 64).bfloat16(), 2, True, 1.0) is None  # past ROUTE_MAX


@needs_kernel
@pytest.mark.parametrize("n", [1, 15, 16, 1024, 1037])
def test_the_residual_add_is_torchs_add_bit_for_bit(n):
    """mlight_add_bf16 (the bound decode step's x += y) against x.add_(y): random values, exact ties between two
    bf16 steps (x + y halfway), huge and tiny magnitudes, infinities and a NaN; lengths off the vector width."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())).bfloat16()
    y = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())).bfloat16()
    if n >= 16:  # a tie: 1 + 2^-8 lies halfway between 1 and the next bf16 (1 + 2^-7), and rounds to even
        x[:6] = torch.tensor([1.0, 1.0 + 2 ** -7, 3e38, float("inf"), float("nan"), -0.0]).bfloat16()
        y[:6] = torch.tensor([2 ** -8, 2 ** -8, 3e38, 1.0, 1.0, 0.0]).bfloat16()
    ref, got = x.clone(), x.clone()
    ref.add_(y)
    row_ops.library().add_bf16(got.data_ptr(), y.data_ptr(), n)
    same = (got.view(torch.int16) == ref.view(torch.int16)) | (got.isnan() & ref.isnan())
    assert same.all(), (got[~same], ref[~same])
