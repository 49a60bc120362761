"""How a request ends, with its tokens scripted: EOS, stop strings, special tokens in the text.

The runner's logits are replaced so that greedy decoding picks a chosen token at each step (the
model's own numbers are checked against transformers elsewhere); what is asserted here is what the
engine makes of those tokens: where it stops, what the output text holds, and why it finished.
"""

from __future__ import annotations

import pytest
import torch

from core.runtime.engine import Engine, Request


@pytest.fixture(scope="module")
def engine(checkpoint_factory):
    e = Engine.load(checkpoint_factory("mixtral"))
    yield e
    e.close()


def run(engine: Engine, monkeypatch, script: list[int], **request) -> tuple:
    """One request whose greedy tokens are `script`, one a step; returns its Result."""
    steps = iter(script)
    real = engine.runner

    def force(out):
        logits, busy = out
        forced = torch.full_like(logits, -1e4)
        forced[:, next(steps)] = 0.0
        return forced, busy

    def runner(*args, **kwargs):
        r = real(*args, **kwargs)
        prefill, decode = r.prefill, r.decode
        r.prefill = lambda *a: force(prefill(*a))
        r.decode = lambda *a: force(decode(*a))
        return r

    monkeypatch.setattr(engine, "runner", runner)
    (result,) = engine.generate([Request(id="r", prompt="a b c", **request)])
    monkeypatch.setattr(engine, "runner", real)
    return result


def plain_tokens(engine: Engine, n: int, avoid: str = "") -> list[int]:
    """n ordinary tokens whose texts are letters only and share no letter with each other or `avoid`."""
    special = set(engine.tokenizer.all_special_ids)
    picked, used = [], set(avoid)
    for i in range(engine.spec.vocab_size):
        text = engine.tokenizer.decode([i])
        if i not in special and text.isalpha() and not used & set(text):
            picked.append(i)
            used |= set(text)
            if len(picked) == n:
                return picked
    raise AssertionError(f"the test tokenizer has no {n} letter-disjoint tokens")


def test_eos_ends_a_request_and_stays_out_of_its_output(engine, monkeypatch):
    a, b, c = plain_tokens(engine, 3)
    eos = min(engine.eos_ids)
    r = run(engine, monkeypatch, [a, b, eos, c, c, c], max_new_tokens=6)
    assert (r.output_token_ids, r.finish_reason) == ([a, b], "stop")
    assert r.output == engine.tokenizer.decode([a, b])
    # any of the model's end tokens ends it, not only the first
    monkeypatch.setattr(engine, "eos_ids", {eos, b})
    r = run(engine, monkeypatch, [a, b, c], max_new_tokens=3)
    assert (r.output_token_ids, r.finish_reason) == ([a], "stop")


def test_special_tokens_are_kept_as_ids_and_left_out_of_the_text(engine, monkeypatch):
    a, b = plain_tokens(engine, 2)
    pad = engine.tokenizer.pad_token_id
    assert pad not in engine.eos_ids
    r = run(engine, monkeypatch, [a, pad, b], max_new_tokens=3)
    assert (r.output_token_ids, r.finish_reason) == ([a, pad, b], "length")
    assert r.output == engine.tokenizer.decode([a]) + engine.tokenizer.decode([b])
    assert engine.tokenizer.pad_token not in r.output


def test_a_stop_string_cut_leaves_special_tokens_out_of_the_text(engine, monkeypatch):
    a, b, c = plain_tokens(engine, 3)
    pad = engine.tokenizer.pad_token_id
    stop = engine.tokenizer.decode([c])
    r = run(engine, monkeypatch, [a, pad, b, c, a], max_new_tokens=5, stop=(stop,))
    assert r.finish_reason == "stop" and r.output_token_ids == [a, pad, b, c]
    assert r.output == engine.tokenizer.decode([a]) + engine.tokenizer.decode([b])


def test_a_stop_string_that_one_token_brings_twice_cuts_at_the_first(engine, monkeypatch):
    """A token like "ill" brings the stop string "l" twice in one step: the text ends before the first."""
    special = set(engine.tokenizer.all_special_ids)
    twice = next(i for i in range(engine.spec.vocab_size) if i not in special
                 and (t := engine.tokenizer.decode([i])).isalpha() and any(t.count(ch) >= 2 for ch in t))
    text = engine.tokenizer.decode([twice])
    ch = next(ch for ch in text if text.count(ch) >= 2)
    (a,) = plain_tokens(engine, 1, avoid=text)
    r = run(engine, monkeypatch, [a, twice, a], max_new_tokens=3, stop=(ch,))
    assert r.finish_reason == "stop"
    assert r.output == engine.tokenizer.decode([a]) + text[:text.find(ch)]


@pytest.mark.parametrize("how", ["eos", "stop string"])
def test_a_request_ending_in_a_step_leaves_the_others_their_token(engine, monkeypatch, how):
    """Two requests in one batch, the one placed first (the longer prompt) ending at its second token: the other
    still gets that step's token, and each the rest of its own."""
    x, y, z, s = plain_tokens(engine, 4)
    end = min(engine.eos_ids) if how == "eos" else s
    stop = (engine.tokenizer.decode([s]),) if how == "stop string" else ()
    long_ids = engine.prompt_token_ids(Request(id="a", prompt="a b c d e f g h"))
    scripts = {"a": iter([x, end]), "b": iter([x, y, z])}
    assert len(engine.prompt_token_ids(Request(id="b", prompt="a b"))) + 3 < len(long_ids)  # positions tell them apart
    real = engine.runner

    def force(out, who):
        logits, busy = out
        forced = torch.full_like(logits, -1e4)
        for row, name in enumerate(who):
            forced[row, next(scripts[name])] = 0.0
        return forced, busy

    def runner(*args, **kwargs):
        r = real(*args, **kwargs)
        prefill, decode = r.prefill, r.decode

        r.prefill = lambda ids, s, g: force(prefill(ids, s, g), ["a" if list(i) == long_ids else "b" for i in ids])
        r.decode = lambda t, s, pos: force(decode(t, s, pos), ["a" if p >= len(long_ids) else "b" for g in pos for p in g])
        return r

    monkeypatch.setattr(engine, "runner", runner)
    got = {r.id: r for r in engine.generate([Request(id="b", prompt="a b", max_new_tokens=3),
                                             Request(id="a", prompt="a b c d e f g h", max_new_tokens=3, stop=stop)])}
    assert got["a"].finish_reason == "stop" and got["a"].output_token_ids == [x] + ([s] if how == "stop string" else [])
    assert (got["b"].output_token_ids, got["b"].finish_reason) == ([x, y, z], "length")


def test_a_sampled_request_without_a_seed_draws_as_seed_0(engine):
    """temperature > 0 and no seed: the request's own generator seeded 0, so a rerun draws the same tokens."""
    def draw(**seed):
        (r,) = engine.generate([Request(id="s", prompt="a b c", temperature=1.5, max_new_tokens=6, **seed)])
        return r.output_token_ids

    assert draw() == draw() == draw(seed=0) != draw(seed=1)
