"""The new families' layers, driven step by step as the runtime will (prefill, then decode one token
at a time through pre_attn / attend / post_attn / experts), against float64 transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from checkpoints import MODEL_ONLY, hf_model
from core.model import decoder
from core.model.families import load_spec
from core.model.kvcache import KVCache, Rows
from core.model.layers import final_logits
from core.model.moe import activation, experts
from core.model.rope import for_spec
from core.model.weights import load_weights

LENGTHS = (3, 30, 11, 70, 1, 19)  # longer than gpt-oss's window (8), Phi's LongRoPE switch (16), a DeltaNet chunk (64)
STEPS = 3


def run(path, prompts):
    spec = load_spec(path)
    W = load_weights(path, spec)
    g, act = W.globals, activation(spec)
    head = g.get("lm_head", g["embed"])
    top = max(map(len, prompts)) + STEPS + 1
    cache, rope = KVCache(spec, len(prompts), top, W.dtype), for_spec(spec, top, W.dtype)

    def routed(lw):
        t = lw.tensors
        return lambda h, wt, idx: experts(h, t["w13"], t["w2"], wt, idx, b13=t.get("b13"), b2=t.get("b2"), act=act)

    def logits(x):
        return final_logits(spec, g["norm"], head, x, g.get("norm_b"), g.get("lm_head_b"))

    lens = [len(p) for p in prompts]
    x = F.embedding(torch.tensor([t for p in prompts for t in p]), g["embed"])
    pos = torch.cat([torch.arange(n) for n in lens])
    calls = torch.cat([torch.full((n,), n) for n in lens])
    for i, lw in enumerate(W.layers):
        x, parts = decoder.prefill_layer(spec, i, lw.tensors, x, pos, rope, lens, routed(lw), calls)
        for slot, p in enumerate(parts):
            cache.layers[i].write_prompt(slot, *p)
    out = [logits(x[torch.tensor(lens).cumsum(0) - 1])]
    seqs = [list(p) for p in prompts]
    for _ in range(STEPS):
        nxt = out[-1].argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        rows = Rows(list(range(len(seqs))), [len(s) - 1 for s in seqs])
        x = F.embedding(torch.tensor(nxt), g["embed"])
        for i, lw in enumerate(W.layers):
            payload, keep = decoder.pre_attn(spec, i, lw.tensors, x, rows.positions, rope, rows.lengths)
            f = decoder.post_attn(spec, i, lw.tensors, x, decoder.attend(spec, i, lw.tensors, payload, cache.layers[i],
                                                                         rows), keep)
            x = decoder.finish(f, None if f.weights is None else routed(lw)(f.h, f.weights, f.idx))
        out.append(logits(x))
    return seqs, out


@pytest.mark.parametrize("family", MODEL_ONLY)
def test_prefill_and_decode_steps_match_float64_transformers(family, checkpoint_factory):
    path = checkpoint_factory(family)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 500, (n,), generator=gen).tolist() for n in LENGTHS]
    seqs, out = run(path, prompts)
    ref = hf_model(path, dtype=torch.float64)
    for b, s in enumerate(seqs):
        with torch.no_grad():
            want = ref(torch.tensor([s])).logits[0]
        for step, got in enumerate(out):
            w = want[len(prompts[b]) - 1 + step]
            rel = (got[b].double() - w).abs().max() / w.abs().max()
            assert rel < 1e-4, f"{family} prompt {b} step {step}: relative error {rel:.2e}"
