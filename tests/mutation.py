"""Mutation testing of the hot modules with mutmut, in a temporary copy of the repository.

    pip install mutmut==3.8.1          # once, into the project's venv (not a test dependency)
    python tests/mutation.py           # every scope below; hours on 2 busy cores (see --sample)
    python tests/mutation.py sampling batching --max-children 2
    python tests/mutation.py schedule --sample 100   # a fixed random sample: an estimate, sooner
    python tests/mutation.py engine --keep /tmp/m    # keep the copy; meanwhile, from another shell:
    python tests/mutation.py engine --report /tmp/m  # the report so far
    python tests/mutation.py engine --recheck /tmp/m # after writing tests: rerun only its survivors

Each scope names a module, the functions of it that are mutated (mutmut's names: `x_<function>`,
`xǁ<Class>ǁ<method>`) and the test files that may kill them (mutmut runs, for each mutant, only
the tests that called the mutated function). The working tree is never touched: the tracked and
untracked-but-not-ignored files are copied to a temporary folder, a `setup.cfg` with the mutmut
configuration is written there, and mutmut runs there (`--keep DIR` keeps the copy for `mutmut
show` / `mutmut browse`).

What is not mutated: the wording of messages (lines that start a `raise`, or continue one with a
string): tests check what a user is told where it matters (tests/test_errors.py), and a mutant
that only changes a letter of a hint is noise, not a gap.

Output: for each scope the mutants, how many the tests killed, and every survivor with its diff and,
where it is a known equivalent mutant (one no test can tell from the original), why; then the
survival rate per scope and overall. Exit 0 always: this is a habit, not a gate.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTMUT = "3.8.1"


@dataclass(frozen=True)
class Scope:
    module: str  # dotted, as mutmut names mutants
    functions: tuple[str, ...]  # mutmut's mangled names (globs) of the functions mutated
    tests: tuple[str, ...]
    skip: tuple[str, ...] = ()  # test ids left out for time (the same code through another family)

    @property
    def path(self) -> str:
        return self.module.replace(".", "/") + ".py"

    def globs(self) -> list[str]:
        # mutmut filters mutants by glob, but looks a name without `*` up as one mutant (asserting
        # `__mutmut_` in it): a bare function name would match nothing and stop the run
        return [f"{self.module}.{f}__mutmut_*" for f in self.functions]


SCOPES = {
    "batching": Scope("core.runtime.batching", ("xǁSlotTableǁ*",),
                      ("tests/test_batching.py", "tests/test_engine_batching.py", "tests/test_compaction.py::"
                       "test_the_highest_requests_fill_the_lowest_holes_within_each_micro_batch")),
    "sampling": Scope("core.model.sampling", ("x_*",), ("tests/test_sampling.py",)),
    "engine": Scope("core.runtime.engine", (
        "xǁRequestǁ*", "xǁ_Seqǁ*", "xǁEngineǁgenerate", "xǁEngineǁ_step", "xǁEngineǁ_admit_check",
        "xǁEngineǁ_choose", "xǁEngineǁ_retire", "x__by_micro_batch", "x__is_oom",
        "xǁEngineǁ_refill", "xǁEngineǁ_compact"),  # the parts of `_step`
        ("tests/test_engine_batching.py", "tests/test_engine_finish.py", "tests/test_engine_parity.py",
         "tests/test_pipeline.py", "tests/test_step_timeline.py",
         "tests/test_compaction.py::test_compacted_requests_keep_their_state[mixtral]"),
        skip=tuple(f"tests/test_engine_parity.py::{t}[{f}]" for t in ("test_greedy_tokens_match_transformers",
                                                                     "test_logits_match_float64_reference")
                   for f in ("dbrx", "qwen2_moe", "qwen3_moe", "olmoe"))
        + tuple(f"tests/test_pipeline.py::test_threaded_matches_sequential_for_every_family[{f}]"
                for f in ("dbrx", "qwen3_moe", "olmoe"))
        # the pipeline's race probe with more page counts: the engine's step loop is the same in each
        + tuple(f"tests/test_pipeline.py::test_threaded_cgopipe_is_race_free[{r}]" for r in range(1, 6))),
    "schedule": Scope("core.runtime.schedule", ("x_*", "xǁTaskǁ*", "xǁ_Graphǁ*"),
                      ("tests/test_schedule.py", "tests/test_schedule_buffers.py", "tests/test_schedule_dataflow.py",
                       "tests/test_schedule_waits.py", "tests/test_simulate.py")),
    "runstore": Scope("core.io.runstore", ("x_*", "xǁRunStoreǁ*"),
                      ("tests/test_resume.py", "tests/test_runstore_durability.py", "tests/test_turns.py",
                       "tests/test_tui_backend.py",
                       "tests/test_cli_run.py", "tests/test_errors.py",
                       "tests/test_app_commands.py::test_rerunning_a_finished_run_says_it_is_done_and_writes_nothing")),
    "planner-memory": Scope("core.plan.planner", (
        "x_memory_use", "x_validate", "x__memory_lin", "x__rw_interval", "xǁBudgetǁ*", "xǁWorkloadǁ*",
        "xǁOverrunǁ*"), ("tests/test_plan.py", "tests/test_planner_memory.py"),
        # time-bound under tracing, and dependent on this machine's free memory
        skip=("tests/test_plan.py::test_plan_time_for_mixtral_on_t4_is_under_half_a_second",
              "tests/test_plan.py::test_detected_machine_plans_without_error")),
}

# Lines whose mutants are message wording, not behaviour (see the module docstring).
NOT_MUTATED = [r"^\s*raise \w+\(", r"^\s*f?\"[^\"]*\"[,)]*$", r"^\s*f?'[^']*'[,)]*$"]

# Known equivalent mutants: (scope, text the mutated line contains, why no test can tell it apart).
EQUIVALENT = [
    ("sampling", "dim=+1", "logits are [B, V]: dim +1 and -1 are the same axis"),
    ("sampling", 'float("-INF")', "float() reads -INF as -inf"),
    ("sampling", "top_k <= logits.shape[-1]", "top_k == V keeps every logit either way"),
    ("sampling", "top_p <= 1.0", "top_p == 1 keeps a nucleus of all tokens: the same distribution"),
    ("sampling", "top_p < 2.0", "top_p <= 1 (Request checks it): as `top_p <= 1.0`"),
    ("schedule", "key=None)", "a weight page's default key is the same (kind, layer, page)"),
    ("schedule", "deps=_buffer_free(G, i, n, g), )", "a weight page's default key is the same (kind, layer, page)"),
    ("schedule", 'key=("XXweight_pageXX", nxt, p))', "attention on the GPU: the pages' only readers follow them "
     "on the in-order copy queue (see the `if t is None` mutant)"),
    ("schedule", "for k in range(j + 1 - g, j - 1)])", "S3/S4: a group's post-attentions precede its FFN on the "
     "same in-order GPU queue"),
    ("schedule", "for k in range(j + 1)])", "the FFN waiting on earlier groups' post-attentions too: they precede it on "
     "the same in-order compute queue, and their own FFNs ran before it"),
    ("schedule", "if (i >= 0 or serial)", "layer 0's pages are not in the graph yet when layer 0 is built (they prefetch "
     "the next step), so its weight list stays empty"),
    ("schedule", "if t is None] if (i > 0 or serial)", "attention on the GPU: each KV load follows the layer's "
     "pages on the same in-order copy queue, and the FFN waits for its attention"),
    ("schedule", 'a = add("pre_attn", i, j, )', "S3: the one chain orders it; S4: the previous layer's FFN precedes "
     "it on the same in-order GPU queue"),
    ("schedule", "if (i > 0 or serial and L == 1) else []", "S3's layer 0: its pages head the one chain; S4 with one "
     "layer: they precede the KV loads on the in-order copy queue, and post-attention waits for the attention that "
     "waits for its KV load; CGOPipe with one layer: the pages are not in the graph yet there (next step's prefetch)"),
    ("batching", "if s >= lo - len(used)]", "zip stops at the holes, as many as the requests past the micro-batch's "
     "front: the highest that many requests are those either way"),
    ("schedule", 'ffn_on: str = "GPU"', "ffn_on is only compared with \"cpu\": any other default is the GPU's"),
    ("schedule", "num_micro_batches: int, pages_per_layer: int = 2,", "the one caller that leaves pages_per_layer out "
     "is CPU-only (tests/test_schedule.py), where no weight page streams: 1 and 2 give the same graph"),
    ("schedule", "self.waited.get((res, other), -2)", "d is a task's index, never negative: d > -1 and d > -2 agree"),
    ("schedule", 'G.add("weight_page", nxt, page=p, deps=free, )', "a prefill adds the next step's layer-0 pages "
     "last: nothing after them looks layer 0's pages up, so the key they are filed under is never read"),
    ("runstore", "if end <= len(data):", "cutting a run file at its own length changes nothing (one more fsync)"),
    ("planner-memory", "1.0 if gw or cw else 1.0", "neither memory depends on r_w only with the FFN on the CPU, "
     "where r_w changes no time either and plan() sets the policy's r_w to 0"),
    ("planner-memory", "abs(slope) < 1.000000001", "slopes are differences of whole byte counts: 0 or at least one "
     "byte per unit fraction; the two differ only at exactly one byte"),
    ("planner-memory", "elif slope >= 0:", "a zero slope took the branch above (abs(slope) < 1e-9)"),
    ("runstore", 'read_text(encoding="UTF-8")', "codec names are case-insensitive"),
    ("runstore", "write_records(self.out, records, None)", "every caller passes output_format(out), which is what "
     "None infers from the suffix"),
    ("runstore", "write_records(self.rejected_path, rejects, None)", "the rejects file ends in .jsonl: None infers "
     "jsonl"),
    ("engine", "round(now - s.started, 7))", "a result's seconds to 0.1 µs instead of 1 µs: nothing reads the 7th "
     "decimal of a measured duration"),
]

# Survivors that the whole suite kills, with tests the scope cannot run under mutmut: (scope, text in
# the mutated line, the test). Spawned processes import the unmutated package.
ELSEWHERE = [
    ("runstore", "ǁdrop_run_file__mutmut_", "tests/test_data_parallel.py::test_a_killed_rank_is_named_and_a_rerun_resumes_"
     "every_rank (slow: torchrun ranks; only the merged output is left)"),
    ("engine", "toks = None", "tests/test_tensor_parallel.py::test_every_family_gives_one_process_tokens_on_2_and_3_"
     "ranks (its ranks run in spawned processes)"),
]


ALIVE = ("survived", "no tests", "suspicious")


def run(cmd: list[str], cwd: Path, log: Path | None = None) -> str:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if log is not None:
        log.write_text(r.stdout + r.stderr, encoding="utf-8")
    return r.stdout


def copy_tree(dst: Path, under: str = "") -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z", *([under] if under else [])],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def write_config(dst: Path, scopes: list[Scope]) -> None:
    tests = sorted({t for s in scopes for t in s.tests})
    lines = ["[mutmut]", "source_paths = core/", "only_mutate ="]
    lines += [f"    {s.path}" for s in scopes]
    lines += ["also_copy =", "    assets/", "do_not_mutate_patterns ="] + [f"    {p}" for p in NOT_MUTATED]
    # slow tests run the CLI in subprocesses, which import the unmutated package: useless and slow here
    skip = [x for s in scopes for t in s.skip for x in ("--deselect", t)]
    # -n 0: pyproject's addopts ask for xdist workers, but mutmut maps tests to functions in its own process
    lines += ["pytest_add_cli_args =", "    -p", "    no:cacheprovider", "    -n", "    0", "    -m", "    not slow"]
    lines += [f"    {x}" for x in skip] + ["pytest_add_cli_args_test_selection ="] + [f"    {t}" for t in tests]
    # mutmut's time limit is wall clock, (tests' own time + constant) x multiplier x 2, and a mutant's
    # pytest session builds its fixtures (a model, a checkpoint) outside the tests' own time: on a
    # busy box a small constant turned most mutants into "timeouts" counted as killed
    lines += ["process_isolation = forkserver", "timeout_multiplier = 4.0", "timeout_constant = 30.0", ""]
    (dst / "setup.cfg").write_text("\n".join(lines), encoding="utf-8")


def results(cwd: Path) -> dict[str, str]:
    out = run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd)
    found = {}
    for line in out.splitlines():
        name, _, status = line.strip().rpartition(": ")
        if name:
            found[name] = status
    return found


def diff_lines(cwd: Path, name: str) -> list[str]:
    out = run([sys.executable, "-m", "mutmut", "show", name], cwd)
    return [x for x in out.splitlines() if x[:1] in "+-" and not x.startswith(("+++", "---"))]


def in_scope(name: str, s: Scope) -> bool:
    return any(fnmatch.fnmatch(name, g) for g in s.globs())


def explained(scope: str, name: str, diff: list[str]) -> tuple[str, str] | None:
    """("equivalent", why) or ("killed elsewhere", by which test) for a known survivor, else None. An
    entry's text is looked for in the mutated line, else in the mutant's name."""
    added = "\n".join(x for x in diff if x.startswith("+"))
    for kind, table in (("equivalent", EQUIVALENT), ("killed elsewhere", ELSEWHERE)):
        for s, text, why in table:
            if s == scope and (text in added or text in name):
                return kind, why
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scopes", nargs="*", metavar="SCOPE", help=f"some of {', '.join(SCOPES)} (default: all)")
    ap.add_argument("--max-children", type=int, default=2, help="parallel mutant runs (default 2)")
    ap.add_argument("--keep", type=Path, help="copy into this folder and keep it (default: a temporary one)")
    ap.add_argument("--sample", type=int, metavar="N", help="run a fixed random sample of N mutants per scope")
    ap.add_argument("--report", type=Path, metavar="DIR", help="only report on a kept copy (also while it runs)")
    ap.add_argument("--recheck", type=Path, metavar="DIR",
                    help="rerun only the survivors of a kept copy, with this tree's tests (after writing a test)")
    args = ap.parse_args(argv)
    try:
        import mutmut  # noqa: F401
    except ImportError:
        print(f"mutmut is not installed: pip install mutmut=={MUTMUT}", file=sys.stderr)
        return 2
    names = args.scopes or list(SCOPES)
    unknown = [n for n in names if n not in SCOPES]
    if unknown:
        ap.error(f"unknown scope {', '.join(unknown)}; choose from {', '.join(SCOPES)}")
    if args.report:
        report(args.report, names, results(args.report))
        return 0
    scopes = [SCOPES[n] for n in names]
    if args.recheck:
        return recheck(args.recheck, names, args.max_children)
    work = args.keep or Path(tempfile.mkdtemp(prefix="mlight-mutation-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # every mutant is a fresh pytest session: let them share the tiny checkpoints (tests/conftest.py)
    os.environ["MLIGHT_TEST_CHECKPOINTS"] = str(work / ".test-checkpoints")
    try:
        copy_tree(work)
        write_config(work, scopes)
        globs = [g for s in scopes for g in s.globs()]
        if args.sample:
            # generate the mutants and collect the test mapping (mutmut then refuses the empty filter) ...
            run([sys.executable, "-m", "mutmut", "run", "--max-children", "1", "no-such-mutant"], work)
            # ... and run a fixed sample of each scope's mutants (a survival-rate estimate, not a census)
            rng, picked = random.Random(17), []
            for s in scopes:
                mine = sorted(k for k in results(work) if in_scope(k, s))
                picked += rng.sample(mine, min(args.sample, len(mine)))
            globs = sorted(picked)
        print(f"mutmut {MUTMUT} on {', '.join(names)} in {work} ...", flush=True)
        out = run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children), *globs], work,
                  log=work / "mutmut-run.log")
        if "failed to collect stats" in out or "Failed to run clean test" in out:
            print("mutmut could not run the tests unmutated (a failing or time-bound test?); its log ends:")
            print("\n".join((work / "mutmut-run.log").read_text(encoding="utf-8").replace("\r", "\n").splitlines()[-30:]))
        status = results(work)
        report(work, names, status)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


def recheck(work: Path, names: list[str], max_children: int) -> int:
    """Copy this tree's tests into a kept copy and rerun its survivors there (same mutants, same sample)."""
    t0 = time.perf_counter()
    os.environ["MLIGHT_TEST_CHECKPOINTS"] = str(work / ".test-checkpoints")
    for rel in ("tests", "mutants/tests"):
        shutil.rmtree(work / rel, ignore_errors=True)
    copy_tree(work, under="tests/")
    write_config(work, [SCOPES[n] for n in names])
    (work / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)  # map the new tests too
    status = results(work)
    alive = sorted(k for k, v in status.items() if v in ALIVE and any(in_scope(k, SCOPES[n]) for n in names))
    print(f"mutmut {MUTMUT}: rechecking {len(alive)} survivors in {work} ...", flush=True)
    if alive:
        run([sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children), *alive], work,
            log=work / "mutmut-recheck.log")
    report(work, names, results(work))
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


def report(work: Path, names: list[str], status: dict[str, str]) -> None:
    rows = []
    for n in names:
        s = SCOPES[n]
        mine = {k: v for k, v in status.items() if in_scope(k, s)}
        counted = {k: v for k, v in mine.items() if v not in ("not checked", "skipped")}
        alive = sorted(k for k, v in counted.items() if v in ALIVE)
        hung = sorted(k for k, v in counted.items() if v == "timeout")
        print(f"\n== {n}: {s.path}: {len(counted)} mutants, {len(counted) - len(alive)} killed "
              f"({len(hung)} of them by the time limit), {len(alive)} alive")
        for k in hung:  # a hang is a kill, but a limit too tight for a busy box looks the same: show them
            print(f"  {k} (timeout)")
        eq = away = 0
        for k in alive:
            d = diff_lines(work, k)
            known = explained(n, k, d)
            eq += known is not None and known[0] == "equivalent"
            away += known is not None and known[0] == "killed elsewhere"
            print(f"  {k} ({counted[k]})" + (f" — {known[0]}: {known[1]}" if known else ""))
            for line in d:
                print(f"      {line.strip()[:150]}")
        rows.append((n, len(counted), len(hung), len(alive), eq, away))
    print("\nscope            mutants  killed (timeouts)  survived  rate    equivalent  killed elsewhere  open")
    total = [sum(r[i] for r in rows) for i in range(1, 6)]
    for n, c, h, a, eq, away in rows + [("all", *total)]:
        rate = a / c if c else 0.0
        print(f"{n:<16} {c:>7}  {c - a:>6} {f'({h})':>10}  {a:>8}  {rate:6.1%}  {eq:>10}  {away:>16}  {a - eq - away:>4}")


if __name__ == "__main__":
    sys.exit(main())
