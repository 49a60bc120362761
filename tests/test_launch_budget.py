"""The launch budget of a steady decode step on the emulated device (issue 42, item 2), for every family with
E ≥ 8 in checkpoints.py, at SM75, SM80 and SM90 settings, with bf16, int8 and int4 experts (CGOPipe, n = 2
micro-batches of 2, p = 2 pages, a quarter of each layer's experts resident and the rest streamed):

- GPU-stream operations per micro-batch per layer do not depend on E (the same layer at E = 8, 64, 128 and
  256 asks for the same ops), and are at most 40 eager;
- event waits per layer are at most 3n + p;
- a decode step after the first blocks the host at most once (its logits).

By default a cover of the matrix runs (every family once, every capability and every format at least once, E = 8
and 256: about a minute on two cores); `MLIGHT_LAUNCH_BUDGET=full` or `MLIGHT_TEST_MATRIX=full` runs all of it
(E = 8, 64, 128, 256 for every family × capability × format: about nine minutes).

Counted by tests/op_count.py (aten ops the tasks dispatch on device data, the device's copies and waits,
the caller's blocking calls and host reads of device data). The shapes: the family's tiny checkpoint, its
experts replicated to E (the router's rows with a little noise, so tokens spread over all of them) and cut
to two layers (one of each kind the family has: dense + MoE, or linear + full attention), so that a shape
costs a file copy, not a transformers model.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.runtime.device_emulated import EmulatedCuda
from core.runtime.engine import Engine
from matrix import FULL as FULL_MATRIX
from op_count import steady_step

FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe")  # checkpoints.py's E ≥ 8
EXPERTS = (8, 64, 128, 256)
CAPS = {"sm75": (7, 5), "sm80": (8, 0), "sm90": (9, 0)}
FORMATS = ("bf16", "int8", "int4")
KEEP = {"qwen3_next": (0, 3), "qwen3_5_moe": (0, 3)}  # a linear-attention layer and the full-attention one
N, MU, PAGES = 2, 2, 2
EAGER_OPS = 40
MiB = 1 << 20


def _widen(src: Path, dst: Path, E: int, keep: tuple[int, ...]) -> Path:
    """src's checkpoint with each MoE layer's experts replicated to E and only the layers `keep`, renumbered."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    key = "n_routed_experts" if "n_routed_experts" in text else "num_experts"
    E0 = text[key]
    text[key] = E
    text["num_hidden_layers"] = len(keep)
    if text.get("layer_types"):
        text["layer_types"] = [text["layer_types"][i] for i in keep]
    (dst / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(E)
    tensors = {n: t for f in sorted(src.glob("*.safetensors")) for n, t in load_file(f).items()}
    out = {}
    for name, t in tensors.items():
        m = re.search(r"\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) not in keep:
            continue
        if m:
            name = name.replace(m.group(0), f".layers.{keep.index(int(m.group(1)))}.", 1)
        e = re.search(r"\.experts\.(\d+)\.", name)
        if e:  # expert i of E is a copy of expert i mod E0
            for i in range(int(e.group(1)), E, E0):
                out[name.replace(e.group(0), f".experts.{i}.")] = t.clone()
            continue
        if name.endswith(("mlp.gate.weight", "e_score_correction_bias")) and t.shape[0] == E0:
            t = t.repeat(E // E0, *([1] * (t.dim() - 1)))
            t = t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype)
        out[name] = t
    save_file({n: v.contiguous() for n, v in out.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def counts(checkpoint_factory, tmp_path_factory):
    """(family, E, format, cap) -> op_count.StepCounts of a steady decode step, each made once."""
    made: dict = {}

    @functools.lru_cache(maxsize=None)
    def shape(family: str, E: int) -> Path:
        src = checkpoint_factory(family)
        keep = KEEP.get(family, (0, 1))
        return _widen(src, tmp_path_factory.mktemp(f"{family}-E{E}"), E, keep)

    def get(family: str, E: int, fmt: str, cap: str):
        key = (family, E, fmt, cap)
        if key not in made:
            dev = EmulatedCuda(512 * MiB, capability=CAPS[cap])
            quant = {} if fmt == "bf16" else dict(quantize=fmt, group_size=32)
            engine = Engine.load(shape(family, E), device=dev, executor="cuda", schedule="cgopipe", dtype="bfloat16",
                                 pages_per_layer=PAGES, resident_experts=(E // 4,) * 2, **quant)
            try:
                made[key] = steady_step(engine, micro_batches=N, micro_batch_size=MU, prompt=4, warm_steps=1)
            finally:
                engine.close()
        return made[key]

    return get


FULL = os.environ.get("MLIGHT_LAUNCH_BUDGET") == "full" or FULL_MATRIX
# the default cover: each family once, each capability and each format at least once
COVER = [("deepseek_v2", "bf16", "sm75"), ("deepseek_v3", "int8", "sm80"), ("glm4_moe", "int4", "sm90"),
         ("qwen3_next", "bf16", "sm90"), ("qwen3_5_moe", "int8", "sm75")]
MATRIX = [(f, fmt, cap) for f in FAMILIES for fmt in FORMATS for cap in CAPS] if FULL else COVER
SHAPES = EXPERTS if FULL else (EXPERTS[0], EXPERTS[-1])
# Eager ops per micro-batch per layer outside the FFN (pre- plus post-attention, the worst layer). The FFN's share
# is 8 on the fused expert path (core.model.fused_moe) in every format and at every capability, constant in E
# (main before it: 18 in bf16 grouped, 105 → 2,585 for int8 and 201 → 5,657 for int4 experts from E = 8 to 256).
# Pinned so that they only go down. The router after its matmul is one op (core.model.fused_router: a Triton kernel
# on a GPU), and an fp32 router's weight is kept in fp32 on the device: DeepSeek-V3's router went from 15 ops to 3
# (h's cast, the matmul, the op), the others' from 5-13 to 2-3; MLA's q_a and kv_a are one product on the device.
TODAY = {"deepseek_v2": 24, "deepseek_v3": 26, "glm4_moe": 20, "qwen3_next": 28, "qwen3_5_moe": 28}


def _per_layer(c) -> list[dict]:
    return [{k: v / N for k, v in sorted(lc.ops.items())} for lc in c.layers]


@pytest.mark.slow
@pytest.mark.parametrize("family,fmt,cap", MATRIX)
def test_ops_outside_the_ffn_do_not_depend_on_the_number_of_experts(counts, family, fmt, cap):
    def outside(c):
        return [{k: v for k, v in row.items() if k != "ffn"} for row in _per_layer(c)]

    want = outside(counts(family, SHAPES[0], fmt, cap))
    for E in SHAPES[1:]:
        assert outside(counts(family, E, fmt, cap)) == want, f"E = {E} against E = {SHAPES[0]}"


@pytest.mark.slow
@pytest.mark.parametrize("family,fmt,cap", MATRIX)
def test_ops_per_micro_batch_do_not_depend_on_the_number_of_experts(counts, family, fmt, cap):
    want = _per_layer(counts(family, SHAPES[0], fmt, cap))
    for E in SHAPES[1:]:
        assert _per_layer(counts(family, E, fmt, cap)) == want, f"E = {E} against E = {SHAPES[0]}"


@pytest.mark.slow
@pytest.mark.parametrize("family,fmt,cap", MATRIX)
def test_ops_per_micro_batch_per_layer_outside_the_ffn_do_not_grow(counts, family, fmt, cap):
    c = counts(family, EXPERTS[-1], fmt, cap)
    worst = max(row["ops_per_mb"] - row.get("ops_ffn", 0) for row in c.table())
    assert worst <= TODAY[family], c.table()


@pytest.mark.slow
@pytest.mark.parametrize("family,fmt,cap", MATRIX)
def test_ops_per_micro_batch_per_layer_are_at_most_40_eager(counts, family, fmt, cap):
    c = counts(family, EXPERTS[-1], fmt, cap)
    over = {i: row for i, row in enumerate(c.table()) if row["ops_per_mb"] > EAGER_OPS}
    assert not over, over


@pytest.mark.slow
@pytest.mark.parametrize("family,fmt,cap", MATRIX)
def test_event_waits_per_layer_are_at_most_3n_plus_p(counts, family, fmt, cap):
    c = counts(family, EXPERTS[-1], fmt, cap)
    assert c.micro_batches == N and c.pages == PAGES
    assert all(c.waits(i) <= 3 * N + PAGES for i in range(len(c.layers))), [c.waits(i) for i in range(len(c.layers))]


@pytest.mark.slow
@pytest.mark.parametrize("family,fmt,cap", MATRIX)
def test_a_steady_decode_step_syncs_the_host_at_most_once(counts, family, fmt, cap):
    assert counts(family, EXPERTS[-1], fmt, cap).host_syncs <= 1


def test_the_counter_sees_one_more_op_and_one_more_host_read(checkpoint_factory):
    """op_count itself: an extra device op in every FFN task and a host read of device data in every
    post-attention (planted through the runner's `fault` seam, which runs inside each task) show up as
    exactly n more FFN ops per layer and n·L more host syncs; a host-only op in a task is not a device op."""
    engine = Engine.load(checkpoint_factory("mixtral"), device=EmulatedCuda(256 * MiB), executor="cuda",
                         schedule="cgopipe", pages_per_layer=PAGES, resident_experts=(1, 1))
    one, host = [], torch.ones(4)

    def plant(task):
        if not one:
            one.append(engine.dev.to_device(torch.ones(4)))
        if task.kind == "ffn":
            one[0].add(1)  # a device op
            host.add(1)  # host work: not the device's
        elif task.kind == "post_attn":
            one[0].tolist()  # a read of device data on the host: a sync on a GPU

    def planted_run(runner):  # this runner alone calls plant before each task
        run = runner._run

        def faulty(task):
            plant(task)
            run(task)

        runner._run = faulty

    try:
        base = steady_step(engine, micro_batches=N, micro_batch_size=MU, prompt=4)
        planted = steady_step(engine, micro_batches=N, micro_batch_size=MU, prompt=4,
                              prepare=planted_run)
    finally:
        engine.close()
    L = len(base.layers)
    assert [lc.ops["ffn"] - lb.ops["ffn"] for lc, lb in zip(planted.layers, base.layers)] == [N] * L
    assert [lc.total_ops - lc.ops["ffn"] for lc in planted.layers] == [lb.total_ops - lb.ops["ffn"]
                                                                          for lb in base.layers]
    assert planted.host_syncs - base.host_syncs == N * L
    assert all(lc.waits == lb.waits for lc, lb in zip(planted.layers, base.layers))



@pytest.mark.slow
def test_the_side_by_side_bench_runs_and_shows_fewer_waits(capsys):
    """bench/launch_budget.py end to end on its smallest shape: today's graph waits more than the new one."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import launch_budget

    assert launch_budget.main(["--shapes", "Mixtral-8x7B", "--formats", "bf16", "--repeat", "1",
                               "--micro-batches", "2", "--pages", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[4]: line.split() for line in lines if line.startswith("Mixtral-8x7B")}
    assert int(rows["today"][8]) > int(rows["new"][8])  # waits per layer
    assert any(line.split()[1] == "t/new" for line in lines if line.strip().startswith("bf16"))
    assert float(rows["main"][6]) > float(rows["new"][6])  # FFN ops per micro-batch: main's expert path issued more
