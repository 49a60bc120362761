"""GGUF in: block decoders bit-equal to the gguf package's, files made with gguf's writer from tiny
checkpoints load and match transformers' own reading of the same file (Qwen3-MoE) or the gguf
package's dequantization in transformers' model (Mixtral, which transformers cannot read from GGUF);
a Q4_K_M-style file (Q4_K with Q6_K down projections in some layers) keeps its blocks as they are."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from checkpoints import make_checkpoint
from core.errors import ModelError, UnsupportedModelError
from core.model.quant.blocks import decode_gguf
from core.model.quant.formats import GGUF_BLOCKS
from core.runtime.engine import Engine, Request
from gguf_files import q4_k_m, quantize, reference_model, write_gguf
from test_engine_parity import PROMPTS

# transformers reads qwen3moe GGUFs with its default moe_intermediate_size (768): the test model uses it;
# K-quants need rows of 256, so hidden is 256
QWEN = dict(hidden_size=256, moe_intermediate_size=768, head_dim=32, num_hidden_layers=3)
MIXTRAL = dict(hidden_size=64, intermediate_size=96)


@pytest.mark.parametrize("kind", list(GGUF_BLOCKS))
def test_block_decoders_are_bit_equal_to_gguf(kind):
    rng = np.random.default_rng(len(kind))
    x = (rng.standard_normal((6, 512)) * np.array([1e-3, 1, 30, 1, 0.1, 1])[:, None]).astype(np.float32)
    x[2, :40] = 0  # an all-zero block
    for raw in (quantize(x, kind), _random_blocks(kind, rng)):
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
        got = decode_gguf(kind, torch.from_numpy(raw)).numpy()
        assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)), kind


def _random_blocks(kind, rng, shape=None):
    """Arbitrary bytes with finite fp16 scales: every bit pattern of the quants and packed scales."""
    bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, shape or (8, 2 * ts), dtype=np.uint8)
    blocks = raw.reshape(-1, ts)
    for at in {"Q8_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (ts - 2,)}.get(kind, ()):
        blocks[:, at:at + 2] = np.float16(rng.uniform(-2, 2, (len(blocks), 1))).view(np.uint8)
    return raw


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    qwen = make_checkpoint("qwen3_moe", root / "qwen-ckpt", **QWEN)
    mix = make_checkpoint("mixtral", root / "mix-ckpt", **MIXTRAL)
    (root / "qkm").mkdir()
    (root / "mix").mkdir()
    (root / "split").mkdir()
    mix_kinds = {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q8_0", "ffn_down_exps": "MXFP4"}
    return {
        "qwen": qwen, "mix": mix,
        "q4_k_m": write_gguf("qwen3_moe", qwen, root / "qkm" / "tiny-Q4_K_M.gguf", lambda n: q4_k_m(n, 3)),
        # Mixtral (GGUF "llama"): gate and up of different types stay apart (w1, w3); q/k rows permuted
        "mixtral": write_gguf("mixtral", mix, root / "mix" / "tiny-mixtral.gguf",
                              lambda n: next((k for p, k in mix_kinds.items() if p in n), "Q8_0")),
        "split": write_gguf("mixtral", mix, root / "split" / "tiny.gguf",
                            lambda n: "F32" if "norm" in n or "inp" in n else "Q8_0", split_max_tensors=10),
    }


def _logits(engine, prompts):
    runner = engine.runner(slots=len(prompts), micro_batch_size=2, max_tokens=64)
    n = len(prompts)
    logits, _ = runner.prefill(prompts, list(range(n)), [list(range(0, n, 2)), list(range(1, n, 2))])
    return logits


def _matches(engine, ref, tol=1e-4):
    """Last-token logits of four prompts of different lengths, ours vs the float64 reference model."""
    prompts = [engine.prompt_token_ids(Request(id=str(i), prompt=p)) for i, p in enumerate(PROMPTS[:4])]
    got = _logits(engine, prompts)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0, -1]
        assert _rel(got[i], want) < tol, f"prompt {i}: relative error {_rel(got[i], want):.2e}"
    return prompts, got


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def test_q4_k_m_file_matches_transformers_reading_it(files):
    from transformers import AutoModelForCausalLM

    path = files["q4_k_m"]
    engine = Engine.load(path, dtype="float32")
    kinds = [{m.name: m.fmt.name for m in lw.layout.scheme.matrices} for lw in engine.weights.layers]
    assert kinds == [{"w13": "Q4_K", "w2": "Q6_K"}, {"w13": "Q4_K", "w2": "Q4_K"}, {"w13": "Q4_K", "w2": "Q6_K"}]
    assert engine.spec.expert_format == "Q4_K/Q6_K" and 4.5 < engine.spec.expert_bits < 5.3
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                               experts_implementation="eager", attn_implementation="eager").double()
    prompts, got = _matches(engine, ref)
    # the same through quantized pages streamed to the emulated GPU, expanded there
    from core.runtime.device_emulated import EmulatedCuda

    streamed = Engine.load(path, dtype="float32", device=EmulatedCuda(256 << 20), executor="cuda", resident_layers=0,
                           pages_per_layer=3)
    assert _rel(_logits(streamed, prompts), got) < 1e-5
    streamed.close()


def test_q4_k_m_blocks_are_kept_as_they_are(files):
    path = files["q4_k_m"]
    engine = Engine.load(path, dtype="float32")
    g = gguf.GGUFReader(path)
    t = next(t for t in g.tensors if t.name == "blk.1.ffn_down_exps.weight")
    parts = engine.weights.layers[1].quant.parts["w2.raw"]
    assert np.array_equal(parts.numpy().reshape(-1), np.asarray(t.data).reshape(-1))  # the file's bytes


def test_tokenizer_and_chat_template_come_from_the_metadata(files):
    from transformers import AutoTokenizer

    engine = Engine.load(files["q4_k_m"], dtype="float32")
    own = AutoTokenizer.from_pretrained(str(files["qwen"]))
    for p in PROMPTS[:3]:
        assert engine.prompt_token_ids(Request(id="a", prompt=p)) == own(p).input_ids
    msgs = [{"role": "user", "content": "Hi"}]
    assert engine.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        own.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert 2 in engine.eos_ids


def test_mixtral_gguf_with_mixed_expert_types(files):
    path = files["mixtral"]
    engine = Engine.load(path, dtype="float32")
    scheme = engine.weights.layers[0].layout.scheme
    assert [(m.name, m.fmt.name) for m in scheme.matrices] == [("w1", "Q4_0"), ("w3", "Q8_0"), ("w2", "MXFP4")]
    _matches(engine, reference_model("mixtral", path, files["mix"]))


def test_split_files_load_as_one_model(files, tmp_path):
    folder = files["split"].parent
    parts = sorted(folder.glob("*.gguf"))
    assert len(parts) > 1 and parts[0].name.endswith("-00001-of-%05d.gguf" % len(parts))
    a = Engine.load(folder, dtype="float32")  # the folder
    b = Engine.load(parts[1], dtype="float32")  # any part names the set
    prompts = [a.prompt_token_ids(Request(id="0", prompt=PROMPTS[1]))] * 2
    assert torch.equal(_logits(a, prompts), _logits(b, prompts))
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / parts[0].name).write_bytes(parts[0].read_bytes())
    with pytest.raises(ModelError, match=f"{parts[1].name} is missing"):
        Engine.load(lonely)


def test_unsupported_architecture_and_type_are_refused_by_name(files, tmp_path):
    w = gguf.GGUFWriter(tmp_path / "bert.gguf", "bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UnsupportedModelError, match="'bert' is not supported"):
        Engine.load(tmp_path / "bert.gguf")
    q2 = write_gguf("qwen3_moe", files["qwen"], tmp_path / "q2k.gguf",
                    lambda n: "Q2_K" if "exps" in n else ("F32" if "norm" in n or "inp" in n else "Q8_0"))
    with pytest.raises(UnsupportedModelError, match="qwen3moe .*Q2_K"):
        Engine.load(q2)


def test_run_and_plan_take_a_gguf_file(files, tmp_path, capsys):
    from app.cli import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\nwhat is up\n")
    out = tmp_path / "o.jsonl"
    assert main(["run", "--model", str(files["mixtral"]), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "3", "--dtype", "float32"]) == 0
    assert len(out.read_text().splitlines()) == 2
    assert main(["run", "--model", str(files["mixtral"]), "--prompts", str(prompts), "--out", str(tmp_path / "q.jsonl"),
                 "--quantize", "int4"]) == 2
    assert "is a GGUF file" in capsys.readouterr().err
    assert main(["plan", "--model", str(files["q4_k_m"]), "--hardware", "t4", "--prompt-len", "77", "--gen-len", "128",
                 "--quantize", "auto"]) == 0
    text = capsys.readouterr().out
    assert "Q4_K/Q6_K experts" in text and "the checkpoint's own Q4_K/Q6_K experts" in text


def test_hub_repo_holding_several_ggufs(files, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from core.io.download import resolve_model
    from test_download import FakeHub

    hub = FakeHub()
    for k, v in {"ENDPOINT": hub.url, "HUGGINGFACE_CO_URL_TEMPLATE": hub.url + "/{repo_id}/resolve/{revision}/{filename}",
                 "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": False, "HF_HUB_DISABLE_XET": True}.items():
        monkeypatch.setattr(constants, k, v)
    split = sorted(files["split"].parent.glob("*.gguf"))
    hub.repos["org/tiny-GGUF"] = {"tiny-Q4_K_M.gguf": files["q4_k_m"].read_bytes(), "README.md": b"# tiny",
                                  **{f"Q8_0/{p.name.replace('tiny', 'tiny-Q8_0')}": p.read_bytes() for p in split}}
    try:
        with pytest.raises(ModelError, match=r"holds 2 GGUF models .*org/tiny-GGUF:Q4_K_M"):
            resolve_model("org/tiny-GGUF")
        path, _ = resolve_model("org/tiny-GGUF:q8_0")  # a split model: every part, no other file
        assert path.name.endswith("-00001-of-%05d.gguf" % len(split)) and not hub.gets("tiny-Q4_K_M.gguf")
        assert len(list(path.parent.glob("*.gguf"))) == len(split)
        engine = Engine.load(path, dtype="float32")
        (r,) = engine.generate([Request(id="a", prompt="Hello", max_new_tokens=2)])
        assert r.output_tokens >= 1
    finally:
        hub.close()
