"""mlight over Ray Data: the callable class on its own, and `mlight run --ray` on a local Ray instance
(`ray.init(num_cpus=2)`) with two actors, which must write exactly what one process writes."""

from __future__ import annotations

import json

import pytest

from app.cli import main

ray = pytest.importorskip("ray", reason="Ray is not installed here: pip install \"mlight[ray]\" to run these tests")
pd = pytest.importorskip("pandas", reason="Ray Data's pandas is not installed")

PROMPTS = ["Tell me about dragons", "What is the capital of France?", "x y z", "Write a haiku about rain",
           "Explain trains", "Hi"]


def _records(path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    for r in rows:
        r.pop("seconds")
    return rows


def test_the_callable_class_runs_a_batch_in_input_order(demo_model):
    from core.runtime.distributed.ray_data import MlightPredictor

    pred = MlightPredictor(str(demo_model), defaults={"max_new_tokens": 4})
    batch = pd.DataFrame([{"id": "b", "prompt": "Hello there", "max_new_tokens": 6, "seed": None},
                          {"id": "a", "prompt": None, "messages": [{"role": "user", "content": "Hi"}], "seed": None},
                          {"id": "c", "prompt": "x y z", "max_new_tokens": float("nan"), "stop": []}])
    out = pred(batch)
    assert list(out["id"]) == ["b", "a", "c"]
    assert list(out["output_tokens"]) == [6, 4, 4] or set(out["finish_reason"]) & {"stop"}
    assert set(out.columns) == {"id", "prompt", "output", "output_token_ids", "prompt_tokens", "output_tokens",
                                "finish_reason", "seconds"}


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_mlight_run_on_ray_with_two_actors_writes_the_one_process_output(local_ray, demo_model, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    common = ["run", "--model", str(demo_model), "--prompts", str(prompts), "--max-new-tokens", "8", "--batch", "2"]
    assert main([*common, "--out", str(tmp_path / "one.jsonl")]) == 0
    assert main([*common, "--out", str(tmp_path / "ray.jsonl"), "--ray", "auto", "--ray-actors", "2"]) == 0
    err = capsys.readouterr().err
    assert "Ray: 2 actors (1 CPU each), batches of 2" in err
    assert _records(tmp_path / "ray.jsonl") == _records(tmp_path / "one.jsonl")
    assert not (tmp_path / "ray.jsonl.run.jsonl").exists()
