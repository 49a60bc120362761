"""bench/llamacpp.py's pure parts: its arguments, reading llama-batched-bench's table, finding a built tree, and
the report's ratios. The side-by-side itself builds llama.cpp (minutes) and is not run here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import llamacpp  # noqa: E402

# llama-batched-bench's output (0c1e570), the log lines around the table included
OUTPUT = """\
llama_context: n_ctx_seq (8256) < n_ctx_train (4096) -- the full capacity of the model will not be utilized
main: n_kv_max = 8256, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, \
n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    64 |     64 |    1 |    128 |    0.120 |   533.33 |    0.841 |    76.10 |    0.961 |   133.19 |
|    64 |     64 |    8 |   1024 |    0.301 |  1701.00 |    3.737 |   137.00 |    4.038 |   253.59 |

llama_perf_context_print:        load time =     210.55 ms
"""


def test_the_batched_bench_table_is_read_row_by_row():
    got = llamacpp.parse_batched_bench(OUTPUT)
    assert got == {1: llamacpp.Rates(533.33, 76.10, 133.19), 8: llamacpp.Rates(1701.0, 137.0, 253.59)}
    assert llamacpp.parse_batched_bench("no table here\n| PP | TG |\n") == {}


def test_arguments():
    a = llamacpp.parse_args(["--formats", "Q8_0,bf16", "--batches", "1,64", "--reps", "3", "--threads", "2"])
    assert (a.formats, a.batches, a.reps, a.threads, a.prompt, a.gen) == (["Q8_0", "bf16"], [1, 64], 3, 2, 64, 64)
    d = llamacpp.parse_args([])
    assert d.formats == ["bf16", "Q8_0", "Q4_K_M"] and d.batches == [1, 8, 32, 64] and d.reps >= 2
    for bad in (["--formats", "Q3_K"], ["--batches", "0"], ["--gen", "1"]):
        with pytest.raises(SystemExit):
            llamacpp.parse_args(bad)


def test_a_tree_is_used_only_with_its_tools_built(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path))
    args = llamacpp.parse_args([])
    assert "LLAMA_CPP_DIR" in llamacpp.find_llama(args)  # a reason with the way to get one, not a crash
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    bin_ = tmp_path / "build" / "bin"
    bin_.mkdir(parents=True)
    for t in llamacpp.TOOLS:
        (bin_ / t).write_text("")
        (bin_ / t).chmod(0o755)
    assert llamacpp.find_llama(args) == llamacpp.LlamaCpp(tmp_path, bin_)


def test_without_llama_cpp_or_a_compiler_it_says_how_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: None)
    assert llamacpp.main(["--cache", str(tmp_path)]) == 2
    assert "cmake" in capsys.readouterr().err


def test_the_report_gives_median_ratios_with_their_spread():
    R = llamacpp.Rates
    ours = {8: [R(200, 100, 150), R(220, 90, 140)]}
    theirs = {8: [R(100, 50, 100), R(100, 60, 100)]}
    text = llamacpp.table("Q8_0", [8], ours, theirs)
    row = text.splitlines()[-1]
    assert row.startswith("| 8 | 95.0 / 55.0 | 1.75 (1.50..2.00) | 210.0 / 100.0 | 2.10 (2.00..2.20) |")


def test_the_commit_is_read_from_the_tools_log():
    assert llamacpp.llama_commit("build: 1 (0c1e570) with GNU 12.2.0 for x86_64") == "0c1e570"
    assert llamacpp.llama_commit("version: 0.5.0-dev (build 1, commit 0c1e570)") == "0c1e570"  # --version
    assert llamacpp.llama_commit("nothing") == "?"
