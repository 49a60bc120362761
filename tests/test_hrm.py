"""The HRM: task FLOPs/bytes, the paper's intensity findings, roofline bounds, affine layer costs."""

import pytest

from core.plan import hrm
from core.plan.hardware import preset
from core.plan.presets import preset_spec

MIXTRAL = preset_spec("mixtral-8x7b")


def test_expected_experts_touched():
    E, k = 8, 2
    assert hrm.expected_experts(1, E, k) == pytest.approx(k)
    assert hrm.expected_experts(2, E, k) == pytest.approx(E * (1 - (1 - k / E) ** 2))  # 3.5, not 4
    assert hrm.expected_experts(64, E, k) == pytest.approx(E, rel=1e-6)
    seq = [hrm.expected_experts(t, 128, 8) for t in (1, 4, 16, 64, 256)]
    assert seq == sorted(seq) and seq[0] == pytest.approx(8) and seq[-1] < 128


def test_moe_bytes_follow_distinct_experts_not_token_count():
    one = hrm.moe_ffn(MIXTRAL, 1)
    many = hrm.moe_ffn(MIXTRAL, 256)
    assert one.bytes == pytest.approx(2 * MIXTRAL.expert_bytes, rel=0.01)
    assert many.bytes == pytest.approx(MIXTRAL.layer_expert_bytes, rel=0.03)  # every expert once, + activations
    assert many.flops == pytest.approx(256 * one.flops)


def intensity(w: hrm.Work) -> float:
    """FLOPs per byte: the roofline's x axis."""
    return w.flops / w.bytes


def test_ffn_intensity_grows_with_micro_batch_but_decode_attention_does_not():
    ffn = [intensity(hrm.moe_ffn(MIXTRAL, mu)) for mu in (1, 8, 32, 128, 512)]
    assert all(b > a * 1.5 for a, b in zip(ffn, ffn[1:]))
    attn = [intensity(hrm.decode_attention(MIXTRAL, mu, 512)) for mu in (1, 8, 32, 128, 512)]
    assert max(attn) / min(attn) < 1.01
    # GQA with 4 query heads per KV head in bf16: ≈ 2·4/2 = 4 FLOP per byte
    assert attn[0] == pytest.approx(4.0, rel=0.05)
    assert ffn[-1] > 25 * attn[-1]


def test_datasheet_rates_are_derated_and_measured_ones_are_not():
    hw = preset("t4")
    r = hrm.effective_rates(hw)
    assert r.gpu_bw == pytest.approx(hw.gpu_bw * hrm.DERATE["gpu_bw"])
    from core.plan.hardware import _apply

    measured = hrm.effective_rates(_apply(hw, {"gpu_bw": 250e9}))
    assert measured.gpu_bw == 250e9
    assert hrm.effective_rates(preset("2xt4")).gpu_flops == pytest.approx(2 * r.gpu_flops)


@pytest.mark.parametrize("attention_on", ["cpu", "gpu"])
def test_layer_seconds_are_affine_in_the_fractions(attention_on):
    r = hrm.effective_rates(preset("l4"))
    kw = dict(batch=512, micro_batch=64, expert_batch=128, attention_on=attention_on, ffn_on="gpu", context=200.0)

    def at(rw, rc):
        return hrm.decode_layer_seconds(MIXTRAL, r, gpu_weight_fraction=rw, gpu_kv_fraction=rc, **kw)

    a, b, c, mid = at(0, 0), at(1, 0.0), at(0, 1.0), at(0.3, 0.6)
    for k in ("compute", "cpu_attn", "h2d", "d2h", "pipeline0", "pipeline1", "pipeline2"):
        assert mid[k] == pytest.approx(a[k] + 0.3 * (b[k] - a[k]) + 0.6 * (c[k] - a[k]), rel=1e-9, abs=1e-12)
    assert b["h2d"] < a["h2d"]  # resident weights are not streamed


def test_cpu_attention_placement_moves_hidden_states_not_kv():
    r = hrm.effective_rates(preset("t4"))
    kw = dict(batch=256, micro_batch=64, expert_batch=64, ffn_on="gpu", gpu_weight_fraction=1.0,
              gpu_kv_fraction=0.0, context=1000.0)
    cpu = hrm.decode_tasks(MIXTRAL, r, attention_on="cpu", **kw)
    gpu = hrm.decode_tasks(MIXTRAL, r, attention_on="gpu", **kw)
    assert "kv_load" not in cpu and "d1" in cpu and "d2" in cpu
    # shipping the KV cache costs far more link time than the QKV / output hidden states
    assert gpu["kv_load"].seconds * gpu["kv_load"].per_layer > 20 * cpu["d2"].seconds * cpu["d2"].per_layer


def test_busy_time_is_sum_of_tasks_per_resource():
    r = hrm.effective_rates(preset("t4"))
    tasks = hrm.decode_tasks(MIXTRAL, r, batch=300, micro_batch=100, expert_batch=300, attention_on="cpu",
                             ffn_on="gpu", gpu_weight_fraction=0.2, gpu_kv_fraction=0.0, context=150.0, pages=6)
    busy = hrm.busy_seconds(tasks)
    assert busy["compute"] == pytest.approx(3 * tasks["pre_attn"].seconds + 3 * tasks["post_attn"].seconds + tasks["ffn"].seconds)
    assert busy["h2d"] == pytest.approx(6 * tasks["weight_page"].seconds + 3 * tasks["d2"].seconds)
    assert tasks["weight_page"].seconds * 6 == pytest.approx(
        0.8 * MIXTRAL.layer_expert_bytes / r.h2d_bw + 6 * 0.8 * hrm.COPY_LAUNCH)


def test_mla_decode_attention_reads_latents_once_for_all_heads():
    """MLA at decode: per cached token one latent of R + dr numbers, shared by every query head (the
    absorbed form), so its FLOPs per byte are ~H times GQA's — the HRM sees latent bytes, not K/V."""
    ds = preset_spec("deepseek-v3")
    t, c, width = 64, 4096, 512 + 64
    a = hrm.decode_attention(ds, t, c)
    assert a.flops == pytest.approx(t * c * 4 * 128 * width)
    assert a.bytes == pytest.approx(t * (c * width + 2 * 128 * width) * 2)
    assert intensity(a) > 50 * intensity(hrm.decode_attention(MIXTRAL, t, c))
    # the D1/D2 payloads are latent-sized too: absorbed queries out, latent outputs back
    assert hrm.dims(ds).d1 == (128 + 1) * width and hrm.dims(ds).d2 == 128 * 512


def test_window_and_linear_layers_stop_growing_with_the_context():
    oss, nxt = preset_spec("gpt-oss-20b"), preset_spec("qwen3-next-80b-a3b")
    per_token = lambda s, c1, c2: (hrm.decode_attention(s, 8, c2).bytes - hrm.decode_attention(s, 8, c1).bytes) / (c2 - c1)  # noqa: E731
    full = lambda s: 8 * 2 * s.num_kv_heads * s.head_dim * s.dtype_bytes  # noqa: E731
    # below the window every gpt-oss layer grows; past it only the full-attention half does
    assert per_token(oss, 16, 64) == pytest.approx(full(oss))
    assert per_token(oss, 1000, 9000) == pytest.approx(full(oss) / 2)
    # Qwen3-Next: 12 of 48 layers grow; the 36 linear ones cost the same at any length, and not nothing
    assert per_token(nxt, 1000, 9000) == pytest.approx(full(nxt) * 12 / 48)
    assert hrm.decode_attention(nxt, 8, 0).bytes > 8 * 36 / 48 * 2 * 32 * 128 * 128 * 4


def test_dense_layers_have_no_experts_to_stream_or_run():
    ds = preset_spec("deepseek-v3")
    frac = 58 / 61  # first_k_dense_replace = 3
    d = hrm.dims(ds)
    assert d.moe_frac == pytest.approx(frac)
    assert hrm.moe_ffn(ds, 16).flops == pytest.approx(frac * 6 * 16 * 8 * 7168 * 2048)
    r = hrm.effective_rates(preset("t4"))
    t = hrm.decode_tasks(ds, r, batch=64, micro_batch=16, expert_batch=16, attention_on="cpu", ffn_on="gpu",
                         gpu_weight_fraction=0.0, gpu_kv_fraction=0.0, context=512, pages=4)
    streamed = t["weight_page"].seconds * t["weight_page"].per_layer - 4 * hrm.COPY_LAUNCH
    assert streamed * r.h2d_bw == pytest.approx(frac * ds.layer_expert_bytes)
