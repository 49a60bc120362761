"""gpt-oss MXFP4 checkpoints: the experts stay 4-bit from file to compute, and compute what transformers'
own MXFP4 dequantization says they hold (biases and the clamped SwiGLU included)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import make_checkpoint
from core.model.families import load_spec
from core.model.moe import clamped_swiglu, experts
from core.model.weights import load_weights

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def encode_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> gpt-oss's (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8): nearest e2m1 value
    under a power-of-two scale that puts the block's largest magnitude at or below 6."""
    g = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = g.abs().amax(-1).clamp_min(2.0 ** -126)
    e = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    idx = (g[..., None] / torch.exp2(e)[..., None, None] - E2M1).abs().argmin(-1).to(torch.uint8)
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return blocks, (e + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_ckpt(tmp_path_factory):
    """A tiny gpt-oss checkpoint whose experts are stored the way the released ones are."""
    path = make_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt-oss-mxfp4"), intermediate_size=64)
    (st,) = path.glob("*.safetensors")
    sd = load_file(st)
    for name in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = sd.pop(name).transpose(-1, -2).contiguous()  # transformers keeps [E, in, out]; the release [E, out, in]
        sd[name + "_blocks"], sd[name + "_scales"] = encode_mxfp4(w)
    save_file(sd, st)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_mxfp4_experts_load_as_four_bit_blocks(mxfp4_ckpt):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    spec = load_spec(mxfp4_ckpt)
    assert spec.expert_format == "mxfp4" and spec.expert_bits == pytest.approx(4.25)
    w = load_weights(mxfp4_ckpt, spec, dtype=torch.float32)
    sd = load_file(next(mxfp4_ckpt.glob("*.safetensors")))
    D, I, E = spec.hidden_size, spec.expert_intermediate, spec.num_experts
    lw = w.layers[1]
    assert lw.experts.dtype == torch.uint8
    weight_bytes = lw.experts.numel() - 4 * E * (2 * I + D)  # less the fp32 biases
    assert weight_bytes <= 1.02 * E * 3 * D * I * 4.25 / 8  # 4.25 bits a weight: never inflated
    p = "model.layers.1.mlp.experts."
    gu = convert_moe_packed_tensors(sd[p + "gate_up_proj_blocks"], sd[p + "gate_up_proj_scales"], dtype=torch.float32)
    down = convert_moe_packed_tensors(sd[p + "down_proj_blocks"], sd[p + "down_proj_scales"], dtype=torch.float32)
    want13 = torch.cat([gu[..., 0::2], gu[..., 1::2]], -1).transpose(-1, -2)  # [E, 2I, D], gate rows first
    want2 = down.transpose(-1, -2)
    q = lw.quant
    for e in range(E):
        assert torch.equal(q.expand(q.scheme.up[0], e), want13[e])  # the same numbers as transformers reads
        assert torch.equal(q.expand(q.scheme.down, e), want2[e])
    # the routed experts with biases and gpt-oss's clamped SwiGLU, against the float64 loop
    g = torch.Generator().manual_seed(0)
    h = torch.randn(9, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(9)])
    rw = torch.softmax(torch.randn(9, 2, generator=g), -1)
    act = clamped_swiglu(spec.swiglu_alpha, spec.swiglu_limit)
    b13, b2 = lw["b13"], lw["b2"]
    got = experts(h, None, None, rw, idx, b13=b13, b2=b2, act=act, quant=q)
    ref = experts(h.double(), want13.double(), want2.double(), rw.double(), idx, grouped=False, b13=b13.double(),
                  b2=b2.double(), act=act)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)



@pytest.fixture(scope="module")
def dequantized_ckpt(mxfp4_ckpt, tmp_path_factory):
    """The same checkpoint with its experts expanded by transformers' own MXFP4 decoder (bf16 layout)."""
    import shutil

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ref = shutil.copytree(mxfp4_ckpt, tmp_path_factory.mktemp("gpt-oss-dequantized") / "m")
    (st,) = ref.glob("*.safetensors")
    sd = load_file(st)
    for name in [k[:-len("_blocks")] for k in sd if k.endswith("_blocks")]:
        sd[name] = convert_moe_packed_tensors(sd.pop(name + "_blocks"), sd.pop(name + "_scales"), dtype=torch.float32)
    save_file(sd, st)
    cfg = json.loads((ref / "config.json").read_text())
    del cfg["quantization_config"]
    (ref / "config.json").write_text(json.dumps(cfg))
    return ref


def test_mlight_run_on_mxfp4_gives_transformers_tokens_on_what_the_blocks_hold(mxfp4_ckpt, dequantized_ckpt, tmp_path):
    """The released gpt-oss format end to end through `mlight run` (CPU mode: the 4-bit experts computed
    where they lie), 7 prompts through 4 slots, against transformers running the dequantized experts."""
    from checkpoints import reference_greedy
    from test_cli_parity import run_cli
    from test_engine_parity import MAX_NEW, PROMPTS
    from transformers import AutoTokenizer

    rows = run_cli(tmp_path, mxfp4_ckpt)
    tok = AutoTokenizer.from_pretrained(str(mxfp4_ckpt))
    for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        want = reference_greedy(dequantized_ckpt, tok(p).input_ids, n)
        got = rows[f"r{i}"]["output_token_ids"]
        assert got == want[:len(got)] and (len(got) == n or rows[f"r{i}"]["finish_reason"] == "stop"), f"r{i}"


def test_mxfp4_pages_stream_to_the_device_as_four_bit_bytes(mxfp4_ckpt, dequantized_ckpt):
    """CGOPipe with every layer's experts streamed in pages: the bytes that cross are the MXFP4 blocks, and
    the tokens are transformers' on the dequantized experts."""
    from checkpoints import reference_greedy
    from core.runtime.engine import Engine, Request
    from test_engine_parity import MAX_NEW, PROMPTS

    engine = Engine.load(mxfp4_ckpt, executor="threaded", schedule="cgopipe", resident_layers=0, pages_per_layer=2)
    engine.eos_ids = set()
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=n) for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]
    steps = []
    try:
        got = {r.id: r.output_token_ids for r in engine.generate(reqs, batch_size=4, micro_batch_size=2,
                                                                 on_event=steps.append)}
    finally:
        engine.close()
    # a decode step streams every layer's expert region (uint8: 4-bit blocks, scales, biases) and little else
    least = min(s.bytes_h2d for s in steps if getattr(s, "kind", None) == "decode")
    blocks = sum(lw.experts.numel() for lw in engine.weights.layers)
    assert engine.weights.layers[0].experts.dtype == torch.uint8 and blocks <= least < 1.2 * blocks
    for r in reqs:
        assert got[r.id] == reference_greedy(dequantized_ckpt, engine.prompt_token_ids(r), r.max_new_tokens), r.id
