"""CPU compute on the CPUs people own: the instruction set read right, the compute dtype chosen from it
and from measured rates, bf16 weights widened tile by tile where bf16 math is slow, and the same
tokens either way. The capability answer is faked so the AVX2 paths run on any CI machine; the AVX2
lane (tests/test_cpu_avx2_lane.py) runs these again under real ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA
limits, where `test_the_avx2_limits_take_effect` checks that they did.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from core.errors import UsageError
from core.model.attention import decode_attention, padding_mask
from core.model.cpu import compute, isa
from core.model.cpu.isa import CpuIsa
from core.model.cpu.kernels import Widen
from test_attention import reference as attention_reference

AVX2_LANE = os.environ.get("MLIGHT_AVX2_LANE") == "1"
ZEN5 = {"avx2": True, "avx512_f": True, "avx512_bw": True, "avx512_bf16": True, "cpu_name": "AMD EPYC"}
HASWELL = {"avx2": True}
SAPPHIRE = {**ZEN5, "amx_tile": True, "amx_bf16": True, "amx_fp16": False}
AVX2_CPU = CpuIsa(hardware="avx2", usable="avx2", bf16_native=False, fp16_native=False)


# ---- the instruction set ---------------------------------------------------------------------------
def test_isa_levels_from_the_cpus_features():
    assert isa.detect(HASWELL, aten="avx2", onednn_bf16=False, env={}).usable == "avx2"
    z = isa.detect(ZEN5, aten="avx512", onednn_bf16=True, env={})
    assert (z.hardware, z.usable, z.bf16_native, z.limited_by) == ("avx512_bf16", "avx512_bf16", True, ())
    assert z.label == "AVX-512 BF16"
    assert isa.detect(SAPPHIRE, aten="avx512", onednn_bf16=True, env={}).usable == "amx"
    # oneDNN says yes to bf16 on an AVX2-only CPU only by emulating it: not native
    assert not isa.detect(HASWELL, aten="avx2", onednn_bf16=True, env={}).bf16_native


def test_env_limits_lower_the_usable_isa_and_say_so():
    env = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    z = isa.detect(ZEN5, aten="avx2", onednn_bf16=False, env=env)
    assert (z.hardware, z.usable, z.bf16_native) == ("avx512_bf16", "avx2", False)
    assert z.limited_by == ("ONEDNN_MAX_CPU_ISA=AVX2", "ATEN_CPU_CAPABILITY=avx2")
    assert z.label.startswith("AVX2 (CPU has AVX-512 BF16; limited by ONEDNN_MAX_CPU_ISA=AVX2")
    only_onednn = isa.detect(ZEN5, aten="avx512", onednn_bf16=False, env={"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"})
    assert only_onednn.usable == "avx512" and not only_onednn.bf16_native


def test_mkl_limit_counts_too():
    """MKL runs torch's fp32 GEMMs on x86 and reads the CPU itself: only MKL_ENABLE_INSTRUCTIONS limits it."""
    z = isa.detect(ZEN5, aten="avx512", onednn_bf16=True, env={"MKL_ENABLE_INSTRUCTIONS": "AVX2"})
    assert (z.usable, z.limited_by) == ("avx2", ("MKL_ENABLE_INSTRUCTIONS=AVX2",))
    assert isa.detect(ZEN5, aten="avx512", onednn_bf16=True, env={"MKL_ENABLE_INSTRUCTIONS": "avx512"}).usable == "avx512_bf16"
    assert isa.detect(HASWELL, aten="avx2", onednn_bf16=False, env={"MKL_ENABLE_INSTRUCTIONS": "AVX2"}).limited_by == ()


# ---- the compute choice -----------------------------------------------------------------------------
AVX512_CPU = CpuIsa(hardware="avx512", usable="avx512", bf16_native=False, fp16_native=False)  # bf16 emulated


def test_measured_rates_decide_where_the_isa_cannot():
    slow = compute.choose("bfloat16", rates={"float32": 120e9, "bfloat16": 10e9}, cpu=AVX512_CPU)
    assert (slow.math, slow.pack, slow.widens) == ("float32", False, True)
    assert "0.08× fp32" in slow.reason
    fast = compute.choose("bfloat16", rates={"float32": 120e9, "bfloat16": 130e9}, cpu=AVX512_CPU,
                          can_pack=lambda: True)
    assert (fast.math, fast.pack, fast.widens) == ("bfloat16", True, False)
    assert compute.choose("bfloat16", cpu=AVX512_CPU).math == "float32"  # not measured: the safe side


def test_a_clear_isa_outvotes_a_noisy_measurement():
    """A busy machine can measure bf16 below fp32 on AVX-512 BF16, or above it under AVX2: the ISA decides."""
    zen5 = isa.detect(ZEN5, aten="avx512", onednn_bf16=True, env={})
    assert compute.choose("bfloat16", rates={"float32": 120e9, "bfloat16": 60e9}, cpu=zen5,
                          can_pack=lambda: True).math == "bfloat16"
    assert compute.choose("bfloat16", rates={"float32": 10e9, "bfloat16": 60e9}, cpu=AVX2_CPU).math == "float32"


def test_without_rates_the_isa_decides_and_packing_is_asked():
    assert compute.choose("bfloat16", cpu=AVX2_CPU).math == "float32"
    zen5 = isa.detect(ZEN5, aten="avx512", onednn_bf16=True, env={})
    assert compute.choose("bfloat16", cpu=zen5, can_pack=lambda: False) == compute.CpuCompute(
        "bfloat16", "bfloat16", False, 0, "AVX-512 BF16 runs bfloat16 matmuls natively")
    assert compute.choose("bfloat16", cpu=zen5, can_pack=lambda: True).pack
    assert compute.choose("float16", cpu=zen5).math == "float32"  # no AMX-FP16 / AVX-512 FP16
    assert compute.choose("float32", cpu=AVX2_CPU).math == "float32"


def test_forced_math_and_bad_requests():
    assert compute.choose("bfloat16", math="float32", cpu=isa.detect(ZEN5, aten="avx512", onednn_bf16=True,
                                                                     env={})).widens
    with pytest.raises(UsageError, match="unknown CPU math dtype"):
        compute.choose("bfloat16", math="int3")
    with pytest.raises(UsageError, match="not supported"):
        compute.choose("float32", math="bfloat16")


# ---- kernels ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("M", [1, 2, 3, 17, 64])
def test_widened_linear_matches_float64_tile_by_tile(M):
    g = torch.Generator().manual_seed(M)
    w = torch.randn(300, 48, generator=g).bfloat16()
    x = torch.randn(M, 48, generator=g)
    wide = Widen(torch.float32, direct_rows=0, tile_bytes=48 * 4 * 32)  # 32-row tiles: 10 of them
    got = wide.linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (M, 300)
    torch.testing.assert_close(got.double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-5)
    assert wide.scratch(1).numel() == 1 and wide._buf.numel() == 32 * 48  # one tile of scratch, reused


def test_gemv_rows_read_the_narrow_weights_directly():
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(64, 32, generator=g).bfloat16(), torch.randn(2, 32, generator=g)
    got = Widen(torch.float32, direct_rows=2).linear(x, w)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x.bfloat16(), w).float())


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_attention_widens_a_bf16_cache(q_dtype, monkeypatch):
    import core.model.attention as attention

    monkeypatch.setattr(attention, "ATTN_TILE_BYTES", 2 * 2 * 12 * 16 * 4 * 2)  # two rows per tile
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, hd, Tmax = 5, 8, 2, 16, 12
    k, v = torch.randn(B, Hkv, Tmax, hd, generator=g).bfloat16(), torch.randn(B, Hkv, Tmax, hd, generator=g).bfloat16()
    q = torch.randn(B, Hq, hd, generator=g).to(q_dtype)
    lens = torch.tensor([3, 12, 7, 1, 9])
    got = decode_attention(q, k, v, lens, hd ** -0.5, (1, 12), padding_mask(lens, 12), widen=Widen(torch.float32))
    assert got.dtype == q_dtype
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), attention_reference(q, k, v, lens, hd ** -0.5), rtol=tol, atol=tol)


# ---- the engine on a CPU without fast bf16 ------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    from checkpoints import make_checkpoint

    return make_checkpoint("qwen2_moe", tmp_path_factory.mktemp("bf16-cpu"), dtype=torch.bfloat16)


PROMPTS = ["Hi", "Tell me a story about a cat", "x y", "Compose an engaging travel blog post about Hawaii."]


def _fake_avx2(monkeypatch):
    import core.model.moe

    monkeypatch.setattr(isa, "cpu_isa", lambda: AVX2_CPU)
    monkeypatch.setattr(core.model.moe, "packing_supported", lambda: False)
    monkeypatch.setattr("core.runtime.engine.cached_cpu_rates", lambda: None)


def test_bf16_on_an_avx2_cpu_widens_and_matches_fp32_math(bf16_model, monkeypatch):
    """No packing, fp32 math, bf16 experts left as they are (no doubling); the same tokens as forcing fp32
    math, and logits within bf16 KV rounding of transformers in fp32 on the same weights."""
    from checkpoints import hf_model
    from core.runtime.engine import Engine, Request

    _fake_avx2(monkeypatch)
    engine = Engine.load(bf16_model)
    assert (engine.cpu.math, engine.cpu.pack) == ("float32", False) and "AVX2" in engine.cpu.reason
    lw = engine.weights.layers[0]
    assert lw["w13"].dtype == torch.bfloat16 and lw["qkv"].dtype == torch.float32
    # experts stay views of the bf16 flat buffer: only the non-expert part was converted (no doubling)
    assert lw["w13"].untyped_storage().data_ptr() == lw.flat.untyped_storage().data_ptr()
    assert engine.weights.nbytes - engine.spec.total_bytes <= 2 * engine.spec.nonexpert_bytes
    engine.eos_ids = set()
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=6) for i, p in enumerate(PROMPTS)]
    got = {r.id: r.output_token_ids for r in engine.generate(reqs, batch_size=3, micro_batch_size=2)}
    forced = Engine.load(bf16_model, cpu_math="float32")
    forced.eos_ids = set()
    assert got == {r.id: r.output_token_ids for r in forced.generate(reqs, batch_size=3, micro_batch_size=2)}
    ref = hf_model(bf16_model)  # fp32 math over the bf16 weights
    ids = [engine.prompt_token_ids(r) for r in reqs[:2]]
    for direct_rows, tol in ((0, 1e-4), (2, 1e-2)):  # GEMV rows read bf16 directly: bf16 rounding there
        engine.cpu = dataclasses.replace(engine.cpu, direct_rows=direct_rows)
        runner = engine.runner(slots=2, micro_batch_size=1, max_tokens=64)
        logits, _ = runner.prefill(ids, [0, 1], [[0], [1]])
        for i, p in enumerate(ids):
            with torch.no_grad():
                want = ref(torch.tensor([p])).logits[0, -1]
            assert (logits[i] - want).abs().max() / want.abs().max() < tol, direct_rows


def test_a_refused_prepack_falls_back_to_the_plain_loop(bf16_model, monkeypatch):
    """packing_supported said yes but the reorder itself raises (a CPU feature oneDNN checks late)."""
    import core.model.moe
    from core.runtime.engine import Engine
    from core.telemetry import WarningEvent

    monkeypatch.setattr(core.model.moe, "packing_supported", lambda: True)
    monkeypatch.setattr(isa, "cpu_isa", lambda: isa.detect(ZEN5, aten="avx512", onednn_bf16=True, env={}))

    def refuse(w, rows):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    events = []
    engine = Engine.load(bf16_model, progress=events.append)
    assert not engine.weights.packed and not engine.cpu.pack
    assert any(isinstance(e, WarningEvent) and "prepack" in e.message for e in events)


def test_prepacked_projections_are_held_once(bf16_model):
    """CPU mode prepacks the projections for oneDNN: the packed copy replaces the row-major bytes in the
    layer's flat buffer instead of sitting beside them (the dense weights were in RAM twice, where the
    planner counts them once). Where oneDNN refuses, the plain weight is held apart the same way."""
    from checkpoints import hf_model
    from core.model.weights import PACKED_DENSE
    from core.runtime.engine import Engine, Request

    engine = Engine.load(bf16_model)
    if not engine.cpu.pack:  # the AVX2 lane: bf16 widened to fp32, nothing prepacked
        pytest.skip("this CPU computes bf16 widened, without prepacking")
    for lw in engine.weights.layers:
        proj = [lw.tensors[n] for n in PACKED_DENSE if n in lw.tensors]
        assert len(proj) >= 3  # qkv, o and the shared expert's
        proj_bytes = sum(t.numel() * t.element_size() for t in proj)
        dense_bytes = lw.layout.expert_start * 2  # elements of the bf16 flat buffer it was loaded as
        rest = len(lw.tensors) - len(proj)
        assert lw.flat.numel() * lw.flat.element_size() <= dense_bytes - proj_bytes + 64 * rest
        assert lw.held == proj_bytes
    ref = hf_model(bf16_model)
    ids = [engine.prompt_token_ids(Request(id="a", prompt=PROMPTS[1], max_new_tokens=1))]
    logits, _ = engine.runner(slots=1, micro_batch_size=1, max_tokens=64).prefill(ids, [0], [[0]])
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits[0, -1]
    assert (logits[0] - want).abs().max() / want.abs().max() < 2e-2


@pytest.mark.skipif(not AVX2_LANE, reason="runs in the AVX2 lane (tests/test_cpu_avx2_lane.py)")
def test_the_avx2_limits_take_effect(bf16_model, capfd):
    from core.runtime.engine import Engine

    cpu = isa.cpu_isa()
    assert cpu.usable == "avx2" and not cpu.bf16_native, cpu
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    if torch.backends.mkl.is_available():  # MKL's fp32 GEMM on its AVX2 code, as on an AVX2 CPU (it says which)
        with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
            torch.randn(64, 64) @ torch.randn(64, 64)
        said = capfd.readouterr().out
        assert "AVX-512" not in said, said[:300]
        if "Intel(R) Advanced Vector Extensions" in said:  # MKL names its code path on Intel CPUs only
            assert "AVX2" in said, said[:300]
    engine = Engine.load(bf16_model, threads=1)
    assert engine.cpu.math == "float32" and not engine.weights.packed
