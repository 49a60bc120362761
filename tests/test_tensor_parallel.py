"""Tensor parallelism over gloo ranks on the CPU: every family, 2 and 3 ranks, the same greedy tokens as
one process. One set of three rank processes is started for the whole module (2 ranks use a subgroup
of it), so the price of starting ranks is paid once."""

from __future__ import annotations

import datetime
import math

import pytest
import torch

from checkpoints import FAMILIES
from core.errors import UsageError
from core.model.families import load_spec
from core.model.shard import chunk, local_spec, plan_shard
from core.runtime.engine import Engine, Request

PROMPTS = ["Hi", "Compose an engaging travel blog post about a recent trip to Hawaii.",
           "What is the capital of France? Answer in one word.", "x y z", "Draft a professional email seeking feedback."]
# (ranks, engine settings): the plain CPU chain, and CGOPipe on the threaded executor with every layer's
# expert slice streamed in two pages through the double buffer (real copies, real dependencies)
CONFIGS = {
    (2, "chain"): {},
    (2, "cgopipe"): dict(executor="threaded", schedule="cgopipe", resident_layers=0, pages_per_layer=2),
    (3, "cgopipe"): dict(executor="threaded", schedule="cgopipe", resident_layers=0, pages_per_layer=2),
    (3, "chain"): {},
}
# every family on 2 and 3 ranks under both settings; the whole cross only where the split differs in kind
# (GQA groups expanded, MLA with a dense layer and a shared expert, sinks with a window, linear attention):
# the others' slices are those same cases, and each rank set costs a full generation per family
CROSSED = ("mixtral", "deepseek_v3", "gpt_oss", "qwen3_next")


def configs(family: str) -> list[tuple[int, str]]:
    return list(CONFIGS) if family in CROSSED else [(2, "cgopipe"), (3, "chain")]


def generate(path, tp=None, **kw) -> dict[str, list[int]]:
    engine = Engine.load(path, tp=tp, **kw)
    engine.eos_ids = set()  # random weights may pick EOS early; compare full lengths
    reqs = [Request(id=str(i), prompt=p, max_new_tokens=5 + i) for i, p in enumerate(PROMPTS)]
    try:
        return {r.id: r.output_token_ids for r in engine.generate(reqs, batch_size=4, micro_batch_size=2)}
    finally:
        engine.close()


def _rank_main(rank: int, size: int, store: str, paths: dict, out) -> None:
    """One rank: join the gloo job, then run every family under every configuration it takes part in."""
    import torch.distributed as dist

    from core.runtime.distributed.tensor_parallel import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    # a collective that waits this long has hung: the rank fails (and the test with it) instead of CI
    wait = datetime.timedelta(seconds=120)
    groups = {2: dist.new_group([0, 1], timeout=wait), 3: dist.new_group([0, 1, 2], timeout=wait)}
    got = {}
    try:
        steps = _watch_collectives()
        for family, path in paths.items():
            for k, name in configs(family):
                if rank < k:
                    got[(family, k, name)] = generate(path, TensorParallel(groups[k]), **CONFIGS[(k, name)])
        got["collectives"] = steps
        got["oom"] = _out_of_memory(rank, TensorParallel(groups[3]), paths)
        got["coord"] = _coordination(rank)
    except BaseException as e:  # noqa: BLE001 - reported to the test process
        got = e
    out.put((rank, got))
    dist.destroy_process_group()


def _watch_collectives() -> list:
    """Every step's all-reduces as issued, beside what `step_collectives` says the step issues (what a
    rank out of memory drains): (issued, predicted) per step."""
    from core.runtime.distributed.tensor_parallel import TensorParallel, step_collectives
    from core.runtime.pipeline import PipelineRunner

    steps, log = [], []
    reduce, start, logits = TensorParallel.all_reduce, PipelineRunner._start_step, PipelineRunner._logits

    def all_reduce(self, t):
        log.append((tuple(t.shape), t.dtype))
        return reduce(self, t)

    def start_step(self, *a, **kw):
        log.clear()
        return start(self, *a, **kw)

    def final(self, *a, **kw):  # the step's tasks are done, its micro-batches still there
        if self.tp is not None:
            steps.append((list(log), step_collectives(self)))
        return logits(self, *a, **kw)

    TensorParallel.all_reduce, PipelineRunner._start_step, PipelineRunner._logits = all_reduce, start_step, final
    return steps


def _out_of_memory(rank: int, tp, paths: dict) -> dict:
    """Rank 1 runs out of memory once mid-decode (the plain chain: before an O-projection sum the others
    wait in; CGOPipe: in CPU attention, on another thread); rank 2 runs out in every step (prefill)."""
    from core.runtime.distributed.tensor_parallel import GroupOutOfMemory
    from core.runtime.pipeline import PipelineRunner

    run, fault_now = PipelineRunner._run, [None]

    def faulty(self, task):  # the rank's runners call this round's fault before each task
        fault_now[0](task)
        run(self, task)

    PipelineRunner._run = faulty
    seen = {}
    for name, kw, where in (("chain", {}, "post_attn"), ("cgopipe", CONFIGS[(3, "cgopipe")], "cpu_attn")):
        for case, who, when in (("once", 1, {3}), ("always", 2, None)):
            engine = Engine.load(paths["olmoe" if name == "chain" else "mixtral"], tp=tp, **kw)
            engine.eos_ids = set()
            count = [0]

            def fault(task, who=who, when=when, where=where):
                if rank != who:
                    return
                if when is None and task.kind in (where, "prefill"):
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
                if when is not None and task.kind == where and task.layer == 1:
                    count[0] += 1
                    if count[0] in when:  # the second decode step's first micro-batch
                        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

            fault_now[0], warnings = fault, []
            reqs = [Request(id=str(i), prompt=p, max_new_tokens=5 + i) for i, p in enumerate(PROMPTS)]
            try:
                out = {r.id: r.output_token_ids for r in engine.generate(
                    reqs, batch_size=4, micro_batch_size=2, on_event=lambda ev: warnings.append(getattr(ev, "message", "")))}
            except GroupOutOfMemory as e:
                out = str(e)
            finally:
                engine.close()
            seen[(name, case)] = (out, [w for w in warnings if w])
    PipelineRunner._run = run
    return seen


def _coordination(rank: int) -> dict:
    """The job-level agreement the CLI's ranks use, on the same three ranks."""
    from core.runtime.distributed import coord

    seen = {}
    coord.agree(None, rank)  # nobody failed: nothing happens
    try:
        coord.agree(UsageError("bad prompts file", "fix it") if rank == 1 else None, rank)
    except coord.Quiet as q:
        seen["agree"] = ("quiet", q.code)
    except UsageError as e:
        seen["agree"] = ("raised", str(e))
    seen["collect"] = coord.collect({"rank": rank}, rank)
    seen["broadcast"] = coord.broadcast("merged" if rank == 0 else None, rank)
    return seen


@pytest.fixture(scope="module")
def tp_results(checkpoint_factory, tmp_path_factory):
    import torch.multiprocessing as mp

    from core.model.cpu import native, row_ops

    paths = {f: str(checkpoint_factory(f)) for f in FAMILIES}
    native.library(), row_ops.library()  # the ranks' C kernels built here once, not by three ranks at once
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = str(tmp_path_factory.mktemp("tp") / "store")
    procs = [ctx.Process(target=_rank_main, args=(r, 3, store, paths, out), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, got = out.get(timeout=900)  # a rank stuck anywhere fails the test instead of hanging CI
        if isinstance(got, BaseException):
            raise AssertionError(f"rank {rank} failed: {got!r}")
        results[rank] = got
    for p in procs:
        p.join(timeout=60)
    return results


@pytest.mark.slow  # the module's three rank processes run every family
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gives_one_process_tokens_on_2_and_3_ranks(family, tp_results, checkpoint_factory):
    want = generate(checkpoint_factory(family))
    for k, name in configs(family):
        for rank in range(k):
            assert tp_results[rank][(family, k, name)] == want, f"{family}: {k} ranks ({name}), rank {rank}"


@pytest.mark.slow
def test_a_failed_step_drains_exactly_the_collectives_the_others_issue(tp_results):
    """What `step_collectives` predicts for a step is what its tasks issued, every family and schedule,
    prefill and decode (a rank out of memory issues the rest of this list with zeros)."""
    for rank in range(3):
        steps = tp_results[rank]["collectives"]
        assert len(steps) > 100
        for issued, predicted in steps:
            assert issued == predicted


@pytest.mark.slow
def test_a_rank_out_of_memory_retries_with_the_group_or_all_stop(tp_results, checkpoint_factory):
    """Rank 1 out of memory once: every rank goes on with the same halved batch and the tokens are one
    process's; rank 2 out of memory at every step: the batch halves to one on every rank, then all stop
    with one message naming it. No rank waits in a collective (the groups' 120 s timeout would fail it)."""
    for name, family in (("chain", "olmoe"), ("cgopipe", "mixtral")):
        want = generate(checkpoint_factory(family), **({} if name == "chain" else CONFIGS[(3, "cgopipe")]))
        for rank in range(3):
            out, warnings = tp_results[rank]["oom"][(name, "once")]
            assert out == want, f"{name}: rank {rank}"
            assert warnings == ["out of GPU memory; continuing with batch 2, micro-batch 2"]
            out, warnings = tp_results[rank]["oom"][(name, "always")]
            assert out == "rank 2 ran out of GPU memory with a batch of one request — give each rank more GPU " \
                          "memory (more GPUs: --tensor-parallel), or shorten the prompts and --max-new-tokens"
            assert warnings == ["out of GPU memory; continuing with batch 2, micro-batch 2",
                                "out of GPU memory; continuing with batch 1, micro-batch 1"]


@pytest.mark.slow
def test_ranks_agree_on_one_error_and_collect_on_rank_0(tp_results):
    """One rank's bad input: rank 0 raises it naming the rank (the one line a user sees), the others
    leave quietly with its exit code; results gather on rank 0 in rank order."""
    assert tp_results[0]["coord"]["agree"] == ("raised", "rank 1: bad prompts file — fix it")
    assert tp_results[1]["coord"]["agree"] == tp_results[2]["coord"]["agree"] == ("quiet", 2)
    assert tp_results[0]["coord"]["collect"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    assert tp_results[1]["coord"]["collect"] is None
    assert all(tp_results[r]["coord"]["broadcast"] == "merged" for r in range(3))


def test_heads_and_expert_width_split_evenly_with_uneven_groups_expanded(checkpoint_factory):
    spec = load_spec(checkpoint_factory("mixtral"))  # 8 query heads over 2 KV heads, width 96
    assert [chunk(8, 3, r) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    shards = [plan_shard(spec, r, 3) for r in range(3)]
    assert [s.q_heads for s in shards] == [(0, 1, 2), (3, 4, 5), (6, 7)]
    # rank 0's heads all use KV head 0 (local GQA); rank 1's straddle both groups (one KV copy per head)
    assert [s.kv_heads for s in shards] == [(0,), (0, 1, 1), (1,)]
    assert [s.kv_owned for s in shards] == [(True,), (False, True, False), (False,)]
    local = [local_spec(spec, s) for s in shards]
    assert [(m.num_heads, m.num_kv_heads, m.expert_intermediate) for m in local] == [(3, 1, 32), (3, 3, 32), (2, 1, 32)]
    with pytest.raises(UsageError, match="at most 8"):
        plan_shard(spec, 0, 9)


def test_a_rank_reads_only_its_slice_of_the_experts(checkpoint_factory, monkeypatch):
    from core.model.safetensors_io import Checkpoint
    from core.model.weights import load_weights

    path = checkpoint_factory("qwen2_moe")
    spec = load_spec(path)
    read = {"expert": 0}
    real = Checkpoint.copy_into

    def spy(self, name, dest, **kw):
        if ".experts." in name:
            read["expert"] += dest.numel()  # the source view copied has exactly dest's shape
        return real(self, name, dest, **kw)

    monkeypatch.setattr(Checkpoint, "copy_into", spy)
    w = load_weights(path, spec, shard=plan_shard(spec, 1, 2))
    full = spec.num_layers * spec.num_experts * 3 * spec.hidden_size * spec.expert_intermediate
    assert read["expert"] == full // 2
    assert w.layers[0].tensors["w2"].shape == (spec.num_experts, spec.hidden_size, spec.expert_intermediate // 2)
    assert math.prod(w.layers[0].tensors["qkv"].shape) < math.prod(spec.layer_shapes()["qkv"])


def test_local_spec_is_what_the_rank_runs(checkpoint_factory):
    spec = load_spec(checkpoint_factory("olmoe"))
    sh = plan_shard(spec, 0, 2)
    m = local_spec(spec, sh)
    assert m.q_size == spec.q_size // 2 and m.layer_shapes()["q_norm"] == (spec.q_size // 2,)  # OLMoE's full qk-norm
    assert m.num_experts == spec.num_experts and m.expert_intermediate == spec.expert_intermediate // 2


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v2", "deepseek_v3", "qwen3_next", "qwen3_5_moe"])
def test_each_rank_holds_exactly_its_rows_of_every_tensor(family, checkpoint_factory):
    """Rank r of 3 loads, through the memory map, the selected rows and columns of every layer tensor
    of the whole model (MLA's per-head up-projections, linear attention's q/k/v/z/b/a rows and conv
    channels, sinks, output-gate rows, expert and dense widths), and zeros for biases rank 0 adds."""
    from core.model.weights import load_weights

    path = checkpoint_factory(family)
    spec = load_spec(path)
    full = load_weights(path, spec)
    kinds = set()
    for rank in range(3):
        shard = plan_shard(spec, rank, 3)
        assert shard.split_attention
        mine = load_weights(path, spec, shard=shard)
        for i in range(spec.num_layers):
            sel, zero = shard.selections(spec, i), shard.leader_only(spec, i)
            kinds |= {n for n in sel if n in ("q", "q_b", "kv_b", "lin_in", "conv", "sinks")}
            for name, t in mine.layers[i].tensors.items():
                want = full.layers[i].tensors[name]
                if name in sel:
                    dim, keep = sel[name]
                    want = want.index_select(dim, torch.tensor(keep))
                if rank and name in zero:
                    want = torch.zeros_like(want)
                assert torch.equal(t, want), f"{family} rank {rank} layer {i} {name}"
    expected = {"deepseek_v2": {"q", "kv_b"}, "deepseek_v3": {"q_b", "kv_b"}, "qwen3_next": {"lin_in", "conv"},
                "qwen3_5_moe": {"lin_in", "conv"}, "gpt_oss": {"sinks"}}.get(family, set())
    assert expected <= kinds


def test_linear_attention_value_heads_take_the_key_heads_they_read(checkpoint_factory):
    spec = load_spec(checkpoint_factory("qwen3_next"))  # 4 value heads reading 2 key heads
    shards = [plan_shard(spec, r, 3) for r in range(3)]
    assert [s.lin_v_heads for s in shards] == [(0, 1), (2,), (3,)]
    assert [s.lin_k_heads for s in shards] == [(0,), (1,), (1,)]
    local = [local_spec(spec, s) for s in shards]
    assert [(m.linear.num_k_heads, m.linear.num_v_heads) for m in local] == [(1, 2), (1, 1), (1, 1)]
    assert [m.layer_state(0).fixed_state_elems for m in local] == [2 * 16 * 16, 16 * 16, 16 * 16]
    with pytest.raises(UsageError, match="4 linear-attention heads"):
        plan_shard(spec, 0, 5)
