"""Data files mlight reads at run time. They live here, inside the package, so that a wheel carries them.

- `mt_bench_questions.jsonl`: the 80 MT-Bench questions (`question_id`, `category`, `turns`, some
  `reference`) from the FastChat project's LLM-judge data, Apache License 2.0 (see NOTICE). They train
  the demo model's tokenizer and make the benchmark prompt mixes.
- `demo_prompts.jsonl`: the first turns of 16 of them, as an mlight prompts file (`--prompts demo`).
- `configs/<name>/config.json`: the config.json of well-known MoE models — bundled presets, so that
  `mlight plan --model mixtral-8x7b` works offline. A new preset is one more folder here.
- `kernels/decode_attention.c`: the fused CPU decode attention, compiled on the user's machine where a C
  compiler exists (core.model.cpu.native).
- `kernels/moe_ffn.c`: a layer's bf16 routed experts in one call on AVX-512 BF16 CPUs, compiled the same
  way (core.model.cpu.ffn); `kernels/moe_ffn_avx2.c`: the same over the same packed bf16 weights in fp32
  math, for AVX2 CPUs.
- `kernels/int4_matmul.c`: the CPU's int4 weight-only matmul for few rows (decode), compiled the same way
  (core.model.cpu.int4).
- `kernels/gguf_matmul.c`: GGUF block formats (Q8_0 … Q6_K, MXFP4) multiplied as the file stores them
  (core.model.cpu.gguf_blocks); `kernels/gguf_token.c`: one token's experts and dense rows with Q8_0 and
  K-quant rows dotted in place, gguf_matmul.c compiled in (core.model.cpu.gguf_token).

Nothing else in mlight reads a file shipped with it; tests/test_packaging.py keeps it that way.
Imports: nothing.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
MT_BENCH = HERE / "mt_bench_questions.jsonl"
DEMO_PROMPTS = HERE / "demo_prompts.jsonl"
CONFIGS = HERE / "configs"
DECODE_ATTENTION_C = HERE / "kernels" / "decode_attention.c"
MOE_FFN_C = HERE / "kernels" / "moe_ffn.c"
MOE_FFN_AVX2_C = HERE / "kernels" / "moe_ffn_avx2.c"
INT4_MATMUL_C = HERE / "kernels" / "int4_matmul.c"
GGUF_MATMUL_C = HERE / "kernels" / "gguf_matmul.c"
GGUF_TOKEN_C = HERE / "kernels" / "gguf_token.c"
ROW_OPS_C = HERE / "kernels" / "row_ops.c"


def config_presets() -> list[str]:
    """The bundled presets' names (a folder listing: cheap enough for `--help`)."""
    return sorted(p.parent.name for p in CONFIGS.glob("*/config.json")) if CONFIGS.is_dir() else []
