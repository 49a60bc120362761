"""Dense weights quantized for the CPU (`--quantize-dense`): F.linear over a QuantWeight against float64
over the dequantized weight, and a whole model against transformers running the same dequantized
attention projections, LM head and experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from checkpoints import make_checkpoint
from core.errors import UsageError
from core.model.quant.dense import QuantWeight, quantize_dense
from core.model.quant.formats import Format, dequantize, quantize
from core.runtime.engine import Engine, Request
from quant_ref import dequantized_hf
from test_engine_parity import PROMPTS

FORMATS = [Format("int8"), Format("int4", 32), Format("int4", 64)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.label)
def test_linear_over_a_quantized_weight_is_the_dequantized_one(fmt, dtype):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 128, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
    x = torch.randn(2, 3, 128, generator=g).to(dtype)  # leading dims as a prefill's
    q = quantize_dense(w, fmt)
    assert isinstance(q, QuantWeight) and q.shape == w.shape and q.dtype == dtype
    ref = F.linear(x.double(), dequantize(fmt, quantize(fmt, w)).double(), b.double())
    got = F.linear(x, q, b)
    assert got.shape == (2, 3, 48) and got.dtype == dtype
    rel = (got.double() - ref).abs().max() / ref.abs().max()
    assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-5), rel  # bf16: the output's own rounding
    with pytest.raises(TypeError, match="only for F.linear"):
        torch.mm(x[0], q.t())


def test_shapes_the_kernel_cannot_take_stay_as_they_are():
    w = torch.randn(48, 96)
    assert quantize_dense(w, Format("int4", 64)) is w  # 96 inputs: not whole groups of 64
    assert quantize_dense(torch.randn(40, 64), Format("int4", 32)).__class__ is torch.Tensor  # 40 rows: not 16s


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return make_checkpoint("mixtral", tmp_path_factory.mktemp("q-dense"))


@pytest.mark.parametrize("quant,dense", [("int8", True), ("int4", True), ("int4", "int8")])
def test_model_with_quantized_dense_weights_matches_transformers_on_them(quant, dense, mixtral):
    """True: the dense weights in the experts' format; "int8": int8 beside int4 experts."""
    fmt = Format("int8") if quant == "int8" else Format("int4", 32)
    dense_fmt = fmt if dense is True else Format(dense)
    engine = Engine.load(mixtral, quantize=quant, group_size=32, quantize_dense=dense, device="cpu")
    layer = engine.weights.layers[0].tensors
    held = {n: layer[n].fmt for n in ("qkv", "o") if isinstance(layer[n], QuantWeight)}
    head = engine.weights.globals["lm_head"]
    assert held == {"qkv": dense_fmt, "o": dense_fmt} and isinstance(head, QuantWeight) and head.fmt == dense_fmt
    ref = dequantized_hf(mixtral, fmt, dense=("q_proj", "k_proj", "v_proj", "o_proj", "lm_head"), dense_fmt=dense_fmt)
    plain = dequantized_hf(mixtral, fmt)  # experts only: the dense quantization must show
    prompts = [engine.prompt_token_ids(Request(id=str(i), prompt=p)) for i, p in enumerate(PROMPTS[:2])]
    runner = engine.runner(slots=2, micro_batch_size=1, max_tokens=max(map(len, prompts)) + 2)
    logits, _ = runner.prefill(prompts, [0, 1], [[0], [1]])
    nxt = logits.argmax(-1).tolist()
    step, _ = runner.decode([nxt[:1], nxt[1:]], [[0], [1]], [[len(prompts[0])], [len(prompts[1])]])
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = ref(torch.tensor([p + [nxt[i]]])).logits[0, -2:]
            other = plain(torch.tensor([p + [nxt[i]]])).logits[0, -2:]
        for got, w, o in ((logits[i], want[0], other[0]), (step[i], want[1], other[1])):
            rel = (got.double() - w).abs().max() / w.abs().max()
            assert rel < 1e-4, f"{quant} prompt {i}: relative error {rel:.2e}"
            assert (o - w).abs().max() / w.abs().max() > 100 * rel  # the reference is not blind to it
    engine.close()


def test_dense_quantization_needs_a_format(mixtral):
    with pytest.raises(UsageError, match="needs a format"):
        Engine.load(mixtral, quantize_dense=True, device="cpu")


def test_run_passes_the_dense_format_to_the_engine(monkeypatch):
    """`mlight run --quantize int4 --quantize-dense [int8]`: the flag alone means the experts' format."""
    from app.cli import build_parser
    from app.commands import run
    from core.io.prompts import PromptSet

    seen = []
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, path, **kw: seen.append(kw)))
    for extra, want in (([], None), (["--quantize-dense"], True), (["--quantize-dense", "int8"], "int8")):
        argv = ["run", "--model", "m", "--prompts", "p.txt", "--out", "o.jsonl", "--quantize", "int4", *extra]
        args = build_parser(argv)[0].parse_args(argv)
        run._load_engine(args, "m", progress=None)
        assert seen[-1].get("quantize_dense") == want
        settings = run._manifest(args, PromptSet("p.txt", "txt", ""), "m", "m")["settings"]
        assert settings.get("quantize_dense") == want
