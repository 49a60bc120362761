"""The AVX2 lane: the CPU-mode and CPU-attention parity tests again, with torch and oneDNN limited to AVX2.

Most CPUs our users have are AVX2-only (most desktop Intel from 12th gen on, AMD Zen 2/3), where
torch's bf16 matmuls are 10–100× slower and oneDNN refuses to prepack bf16 weights. CI and dev
machines often have AVX-512 BF16, so this runs the parity tests in a child pytest under
ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2 (MKL, torch's fp32 GEMM,
heeds neither of the others; all are read at start-up, hence the subprocess):
the fp32 and bf16 engines against transformers and float64, decode attention, the expert kernels (the
fp32-math one an AVX2 CPU runs bf16 experts on), the row ops, the dense projections' choice of kernel,
the compute choice, and the threaded CGOPipe graph whose CPU attention runs beside a "device".
`test_the_avx2_limits_take_effect` in the child fails if the limits did not take.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# the families whose CPU code differs where the ISA does: GQA decode attention (the C kernel), its window and
# sinks, MLA with a dense layer and a shared expert, linear attention, LayerNorm rows with LongRoPE; the other
# families repeat these paths, and the full set runs outside the lane
LANE_FAMILIES = ("mixtral", "gpt_oss", "deepseek_v3", "qwen3_next", "phimoe")
LANE = [
    "test_cpu_compute.py",
    "test_attention.py",
    "test_moe.py",
    "test_cpu_ffn_avx2.py",
    "test_cpu_row_ops.py",
    "test_cpu_panel_linear.py",
    "test_gguf_native.py",
    "test_gguf_int8.py",
    "test_gguf_token.py",
    "test_gguf_block_dense.py",
    *(f"test_engine_parity.py::{test}[{family}]" for test in ("test_greedy_tokens_match_transformers",
                                                              "test_logits_match_float64_reference")
      for family in LANE_FAMILIES),
    # the threaded graph on Mixtral: the test's other families (DBRX, Qwen3-MoE, OLMoE) repeat its GQA paths
    "test_pipeline.py::test_threaded_matches_sequential_for_every_family[mixtral]",
]
# tests of the listed files that set the ISA themselves (a patched cpu_isa and packing check): the lane's limits
# do not reach them, and they run outside it
NOT_IN_LANE = ["test_cpu_compute.py::test_a_refused_prepack_falls_back_to_the_plain_loop"]
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "MLIGHT_AVX2_LANE": "1"}


@pytest.mark.slow
@pytest.mark.timeout(900)  # a child pytest: on a loaded machine it can outlast the suite's 300 s default
@pytest.mark.skipif(os.environ.get("MLIGHT_AVX2_LANE") == "1", reason="already inside the lane")
def test_cpu_parity_under_avx2_limits(tmp_path):
    env = {**os.environ, **AVX2_ENV, "MLIGHT_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         "-o", "addopts=", "-rs", *(str(TESTS / t) for t in LANE),
         *(arg for t in NOT_IN_LANE for arg in ("--deselect", f"{TESTS.name}/{t}"))],  # node ids: from the root
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=850)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert "test_the_avx2_limits_take_effect" not in tail.split("short test summary")[-1], tail  # it ran
