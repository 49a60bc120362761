"""The norms in one fused kernel (core.model.layers.normed), against transformers' own modules, bit for bit in
fp32, bf16 and fp16: Llama's RMSNorm (the statistics in fp32, rounded, then the weight), gpt-oss's (the weight
applied in fp32, then rounded), Qwen3-Next's zero-centred one (1 + w, in fp32), and LayerNorm. The torch forms
run here (the CPU's C row kernels are off), as on a GPU. And each is one device op (issue 42's launch budget;
the written-out RMSNorm was 8)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

from core.model import layers
from core.model.cpu import row_ops

D = 512


@dataclasses.dataclass
class _Spec:
    norm: str
    norm_eps: float = 1e-6


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def torch_forms(monkeypatch):
    monkeypatch.setattr(row_ops, "library", lambda: None)


def _reference(kind: str, w: torch.Tensor, dtype: torch.dtype):
    cls = {"rms": LlamaRMSNorm, "rms_fp32": GptOssRMSNorm, "rms_offset": Qwen3NextRMSNorm}[kind]
    m = cls(D, eps=1e-6)
    m.weight.data = w.clone()
    return m.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,ops", [("rms", 2), ("rms_fp32", 1), ("rms_offset", 3)])
def test_rms_norms_equal_transformers_bit_for_bit_in_few_ops(kind, ops, dtype):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(64, D, generator=g)).to(dtype)
    w = (0.5 * torch.randn(D, generator=g) + (0.0 if kind == "rms_offset" else 1.0)).to(dtype)
    with torch.no_grad():
        want = _reference(kind, w, dtype)(x)
        got = layers.norm(_Spec(kind), x, w)
    with torch.inference_mode(), _Ops() as m:  # the ops as a GPU dispatches them (the CPU's autograd layer
        layers.norm(_Spec(kind), x, w)  # writes the fused op out; tests/op_count.py counts it once)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(m.ops) <= ops, m.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layernorm_is_torchs_in_one_op(dtype):
    g = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(s, generator=g).to(dtype) for s in ((8, D), (D,), (D,)))
    with _Ops() as m:
        got = layers.norm(_Spec("layernorm", 1e-5), x, w, b)
    torch.testing.assert_close(got, torch.nn.LayerNorm(D, eps=1e-5).to(dtype).requires_grad_(False).__class__
                               .forward(_ln(w, b, dtype), x), rtol=0, atol=0)
    assert m.ops == ["native_layer_norm.default"]


def _ln(w, b, dtype):
    m = torch.nn.LayerNorm(D, eps=1e-5).to(dtype)
    m.weight.data, m.bias.data = w.clone(), b.clone()
    return m.requires_grad_(False)


def test_a_latent_norm_of_a_split_view():
    """MLA's norms take a split of a projection (not contiguous): the same values as of its copy."""
    g = torch.Generator().manual_seed(2)
    c = torch.randn(4, 96, generator=g, dtype=torch.bfloat16)[:, :64]
    w = torch.randn(64, generator=g, dtype=torch.bfloat16)
    torch.testing.assert_close(layers.rms_norm(c, w, 1e-6), layers.rms_norm(c.contiguous(), w, 1e-6),
                               rtol=0, atol=0)
