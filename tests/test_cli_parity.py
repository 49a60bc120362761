"""`mlight run` on every family gives transformers' greedy tokens (batch of 7 prompts, 2 micro-batches,
refill), and every executor × schedule on the command line gives the same tokens."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from checkpoints import FAMILIES, reference_greedy
from test_engine_parity import MAX_NEW, PROMPTS


def run_cli(tmp_path, model, *extra) -> dict[str, dict]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p, "max_new_tokens": n}) + "\n"
                               for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))), encoding="utf-8")
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}.jsonl"
    assert main(["run", "--model", str(model), "--prompts", str(prompts), "--out", str(out), "--batch", "4",
                 "--micro-batch", "2", *extra]) == 0
    return {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}


@pytest.mark.parametrize("family", FAMILIES)
def test_mlight_run_matches_transformers_generate(family, checkpoint_factory, tmp_path):
    path = checkpoint_factory(family)
    rows = run_cli(tmp_path, path)
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(str(path))
    eos = GenerationConfig.from_pretrained(str(path)).eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        ids = tok(p).input_ids
        out = reference_greedy(path, ids, n)  # generate() stopping at EOS gives this up to the first EOS
        stop = next((k for k, t in enumerate(out) if t in eos), None)
        want = out if stop is None else out[:stop]  # we stop at EOS and leave it out
        row = rows[f"r{i}"]
        assert row["output_token_ids"] == want, f"{family} r{i}"
        assert row["finish_reason"] == ("length" if stop is None else "stop")
        assert row["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("executor,schedule", [("threaded", "cgopipe"), ("threaded", "s4"), ("sequential", "s3")])
def test_every_executor_and_schedule_flag_gives_the_same_tokens(executor, schedule, checkpoint_factory, tmp_path):
    path = checkpoint_factory("mixtral")
    base = run_cli(tmp_path, path)
    other = run_cli(tmp_path, path, "--executor", executor, "--schedule", schedule)
    assert {k: r["output_token_ids"] for k, r in other.items()} == {k: r["output_token_ids"] for k, r in base.items()}
