"""The resource that runs the dense work and the experts is "compute" in code (it was "gpu", which in the CPU-only
mode named the CPU). Outside readers keep what they read: JSON outputs carry "gpu" beside "compute" with the
same value, a JSON bottleneck still says "gpu", and Python dicts of busy seconds read "gpu" as an alias."""

import dataclasses
import json

import pytest

from app.cli import main
from core.plan.hardware import preset
from core.plan.policy import Prediction
from core.runtime import schedule
from core.telemetry import RESOURCES, Busy, StepDone, with_gpu_keys
from test_plan_cli import no_gpu  # noqa: F401 - the fixture: no NVML, an isolated cache dir

# where `mlight plan --json` carried a "gpu" key before the rename (GPU and CPU-only plans, with --simulate)
PLAN_GPU_KEYS = [("prediction", "layer_seconds"), ("prediction", "prefill_layer_seconds"),
                 ("prediction", "decode_busy"), ("prediction", "prefill_busy"),
                 *(("simulation", s, "utilization") for s in schedule.SCHEDULES)]


def _at(data, path):
    for k in path:
        data = data[k]
    return data


def _dicts(x):
    if isinstance(x, dict):
        yield x
        for v in x.values():
            yield from _dicts(v)
    elif isinstance(x, list):
        for v in x:
            yield from _dicts(v)


def test_the_resource_is_named_compute_in_resources_and_the_schedule():
    assert RESOURCES == ("compute", "cpu_attn", "h2d", "d2h")
    dense = ("pre_attn", "post_attn", "ffn", "gpu_attn", "prefill")
    assert {schedule.RESOURCE_OF[k] for k in dense} == {"compute"}
    assert set(schedule.RESOURCE_OF.values()) <= set(RESOURCES)


def test_a_cpu_engine_run_reports_compute_and_reads_gpu_as_its_alias(demo_model):
    from core.runtime.engine import Engine, Request

    events = []
    engine = Engine.load(demo_model)
    try:
        list(engine.generate([Request(id=f"r{i}", prompt="Hello there", max_new_tokens=4) for i in range(2)],
                             batch_size=2, micro_batch_size=1, on_event=events.append))
    finally:
        engine.close()
    steps = [e for e in events if isinstance(e, StepDone)]
    assert {e.kind for e in steps} == {"prefill", "decode"}
    for e in steps:
        assert "compute" in e.busy and e.busy["compute"] > 0 and set(e.busy) <= set(RESOURCES), e.busy
        assert "gpu" not in e.busy  # an alias, not a key: summing the busy seconds counts compute once
        assert e.busy["gpu"] == e.busy.get("gpu") == e.busy["compute"]
    with pytest.raises(KeyError):
        steps[0].busy["tpu"]
    # a producer still writing the old key is read under the new one
    assert StepDone("decode", 1, 0.1, {"gpu": 0.07, "cpu_attn": 0.02}).busy == {"compute": 0.07, "cpu_attn": 0.02}


def _plan_json(capsys, hardware: str) -> dict:
    assert main(["plan", "--model", "olmoe-1b-7b", "--hardware", hardware, "--prompt-len", "64", "--gen-len", "32",
                 "--simulate", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("where", ["gpu", "cpu-only"])
def test_plan_json_carries_gpu_beside_compute_with_the_same_value(where, capsys, tmp_path):
    hw = preset("t4")
    if where == "cpu-only":
        hw = dataclasses.replace(hw, name="cpu", gpu_name=None, gpu_count=0)
        (tmp_path / "cpu.json").write_text(json.dumps(hw.to_dict()))
    data = _plan_json(capsys, "t4" if where == "gpu" else str(tmp_path / "cpu.json"))
    assert data["policy"]["ffn_on"] == ("gpu" if where == "gpu" else "cpu")  # a place: untouched
    for path in PLAN_GPU_KEYS:
        d = _at(data, path)
        assert d["gpu"] == d["compute"] and d["compute"] > 0, (path, d)
    for d in _dicts(data):  # and nowhere one without the other
        assert ("gpu" in d) == ("compute" in d) and d.get("gpu") == d.get("compute"), d
    pred = Prediction.from_dict(data["prediction"])  # the JSON reads back as it was planned
    assert "gpu" not in pred.layer_seconds
    assert pred.layer_seconds["compute"] == data["prediction"]["layer_seconds"]["gpu"]
    if where == "cpu-only":  # the dense work and experts bound it: Python says compute, the JSON as it always did
        assert pred.bottleneck == "compute" and data["prediction"]["bottleneck"] == "gpu"


def test_a_prediction_reads_the_old_key_and_round_trips_through_json():
    old = Prediction(tokens_per_s=1.0, decode_tokens_per_s=2.0, prefill_tokens_per_s=3.0, bottleneck="gpu",
                     gpu_bytes=0, cpu_bytes=0, layer_seconds={"gpu": 0.004, "cpu_attn": 0.001})
    assert old.bottleneck == "compute" and old.bottleneck_text.startswith("GPU compute")
    assert dict(old.layer_seconds) == {"compute": 0.004, "cpu_attn": 0.001} and old.layer_seconds["gpu"] == 0.004
    d = json.loads(json.dumps(with_gpu_keys(old.to_dict())))  # as `mlight plan --json` writes it
    assert d["layer_seconds"] == {"compute": 0.004, "cpu_attn": 0.001, "gpu": 0.004} and d["bottleneck"] == "gpu"
    assert Prediction.from_dict(d) == old
    assert sum(Busy({"gpu": 1.0, "compute": 1.0, "h2d": 2.0}).values()) == 3.0  # both keys: compute once


def test_bench_json_carries_gpu_beside_compute(no_gpu, capsys, demo_model, monkeypatch):  # noqa: F811
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["bench", "--model", str(demo_model), "--requests", "2", "--gen-len", "3", "--batch", "2",
                 "--micro-batch", "1", "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    for d in (run["layer_seconds"], run["predicted"]["layer_seconds"]):
        assert d["gpu"] == d["compute"] > 0, d
