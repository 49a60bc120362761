"""The terminal app's backend where it must agree with `mlight run`: what an unfinished run file holds,
the OpenAI Batch output of a run started in the app, and the workload it plans for.

Runs here go through the app's own RunJob and Backend (run store, manifest, final records) with a
small stand-in engine, so only the engine's speed is left out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from app.tui.backend import CHARS_PER_TOKEN, Backend
from app.tui.runjob import RunJob
from core.io.runstore import RunStore, final_records
from core.plan.hardware import preset
from core.runtime.engine import Result
from core.telemetry import ignore
from test_app_support import FrozenClock, ScriptedBackend

DATA = Path(__file__).parent / "data" / "io"
MANIFEST = {"model": {"source": "m"}, "prompts": {"sha256": "p"}, "settings": {}, "policy": {}}


def rec(i, output="o") -> dict:
    return {"id": str(i), "prompt": "p", "output": output, "output_token_ids": [1], "prompt_tokens": 1,
            "output_tokens": 1, "finish_reason": "length", "seconds": 0.1}


def held(info: str) -> int:
    m = re.search(r"(\d+) finished result", info)
    assert m, info
    return int(m.group(1))


def test_resume_info_counts_finished_results_not_the_manifest(tmp_path):
    out = tmp_path / "o.jsonl"
    with RunStore(out) as st:
        st.start(MANIFEST)
        assert held(Backend.resume_info(out)) == 0
        st.append(rec(1))
        st.append(rec(2))
    assert held(Backend.resume_info(out)) == 2


def test_resume_info_counts_what_a_resume_keeps(tmp_path):
    """A repeated result counts once and a torn last line (a kill mid-write) not at all, as on resume."""
    out = tmp_path / "o.jsonl"
    with RunStore(out) as st:
        st.start(MANIFEST)
        for r in (rec(1), rec(2), rec(1, "again")):
            st.append(r)
    with open(out.with_name("o.jsonl.run.jsonl"), "ab") as f:
        f.write(b'{"id": "3", "prom')
    shown = held(Backend.resume_info(out))
    with RunStore(out) as st:
        st.start(MANIFEST)
        assert shown == len(st.done) == 2


class EchoEngine:
    """Stands in for the engine: one fixed answer per request, in order."""

    context_length = 4096

    def prompt_token_ids(self, req) -> list[int]:
        text = req.prompt if req.prompt is not None else json.dumps(req.messages)
        return list(range(len(text.split())))

    def generate(self, requests, *, batch_size=None, micro_batch_size=None, on_event=ignore, should_stop=None):
        for r in requests:
            n = len(self.prompt_token_ids(r))
            yield Result(r.id, r.prompt or "", f"answer to {r.id}", [7] * 2, n, 2, "length", 0.01)


class EchoBackend(ScriptedBackend):
    def engine(self, path, policy=None, progress=ignore, choices=None):
        return EchoEngine()


def test_a_run_of_an_openai_batch_file_in_the_app_writes_batch_output(tmp_path, demo_model):
    b = EchoBackend(hardware=preset("t4"), clock=FrozenClock())
    machine = b.machine()
    model = b.open_model("demo", machine)
    prompts = b.read_prompts(DATA / "openai_batch.jsonl")
    plan = b.plan(model, machine, prompts, None, None)
    out = tmp_path / "batch out.jsonl"
    assert RunJob(b, model, prompts, plan, out, lambda m: None).run() == "done"
    rows = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert [r["custom_id"] for r in rows] == ["request-1", "request-2", "request-3"]
    for r in rows:
        body = r["response"]["body"]
        assert r["response"]["status_code"] == 200 and r["error"] is None
        text = body["choices"][0].get("message", {}).get("content", body["choices"][0].get("text"))
        assert text == r["output"] == f"answer to {r['custom_id']}"
    # exactly what `mlight run` writes for the same results (up to the creation time)
    want = final_records(prompts.prompts, {r["id"]: {k: r[k] for k in rec(0)} for r in rows}, model.name)
    for r in rows + want:
        r["response"]["body"].pop("created")
    assert rows == want


def test_the_app_plans_for_its_longest_prompt(tmp_path):
    lengths = [20, 24, 16, 400, 20]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": "x" * n}) + "\n" for n in lengths), encoding="utf-8")
    b = Backend(hardware=preset("t4"))
    w = b.workload(b.read_prompts(path))
    assert w.longest_prompt * CHARS_PER_TOKEN >= max(lengths)  # KV room for the longest prompt
    assert w.prompt_len * CHARS_PER_TOKEN < max(lengths) / 2  # the average is far below it
    assert w.num_requests == len(lengths)


def test_the_machine_screen_shows_the_instruction_set_and_each_dtypes_rate():
    """An AVX2 CPU's bf16 matmuls run at a hundredth of its fp32 ones: the Machine screen says which (the rates a
    probe measured), beside the ISA; a preset without measured rates keeps its one datasheet figure."""
    import dataclasses

    from app.tui.backend import machine_view

    t4 = preset("t4")
    measured = dataclasses.replace(t4, cpu_isa="avx2", cpu_isa_hw="avx512_bf16", cpu_isa_limits=("ONEDNN_MAX_CPU_ISA=AVX2",),
                                   cpu_matmul={"float32": 1.22e11, "bfloat16": 1.0e9, "int8": 8e10})
    rows = dict(machine_view(measured).cpu_rows)
    assert rows["Instructions"].startswith("AVX2 (CPU has AVX-512 BF16; limited by ONEDNN_MAX_CPU_ISA=AVX2")
    assert rows["Compute"] == "fp32 122 · bf16 1 GFLOP/s (measured)"
    rows = dict(machine_view(t4).cpu_rows)
    assert rows["Compute"] == "1.7 TFLOP/s (datasheet)" and rows["Instructions"] == "AVX-512"
    three = dataclasses.replace(measured, cpu_isa_limits=("ONEDNN_MAX_CPU_ISA=AVX2", "ATEN_CPU_CAPABILITY=avx2",
                                                          "MKL_ENABLE_INSTRUCTIONS=AVX2"))
    assert dict(machine_view(three).cpu_rows)["Instructions"] == \
        "AVX2 (CPU has AVX-512 BF16; limited by 3 settings in the environment)"


def test_a_gguf_file_opens_in_the_app_as_mlight_run_takes_it(tmp_path):
    """Defect: the Model step read only folders of safetensors ("… is not a folder") where `mlight run --model
    FILE.gguf` runs the file; a GGUF repo downloaded from the hub lands as a file too. The step now shows the
    file's own spec and bytes, and the Plan step counts prompts with the file's own tokenizer."""
    from checkpoints import make_checkpoint
    from core.model.gguf.load import load_spec, load_tokenizer, open_gguf
    from gguf_files import uniform, write_gguf
    from test_gguf_reference import SHAPES

    ckpt = make_checkpoint("mixtral", tmp_path / "ckpt", **SHAPES["mixtral"])
    path = write_gguf("mixtral", ckpt, tmp_path / "a model ü.gguf", uniform("Q8_0"))
    b = Backend()
    model = b.open_model(str(path), None)
    assert model.path == path and model.source == "folder"
    assert model.spec == load_spec(open_gguf(path)) and model.disk_bytes == path.stat().st_size
    tok = b.tokenizer(model)
    assert tok("hello world").input_ids == load_tokenizer(open_gguf(path))("hello world").input_ids
