"""GGUF in: a llama.cpp / Ollama / LM Studio model file read as an mlight checkpoint.

`files` finds the file (a .gguf, its split `-0000N-of-0000M` siblings, or the one GGUF in a folder) and
reads its metadata and tensor index with the `gguf` package; `arch` turns the metadata into the config
of one of our families and names each GGUF tensor's place in our canonical layer; `load` fills the
per-layer flat buffers — dense tensors expanded to the compute dtype one at a time, expert blocks
(Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4) kept as they are in the file, so RAM, pages and the wire carry
the file's own bytes — and builds the tokenizer (and chat template) from the metadata with transformers.
Imports: core.model (spec, families, weights, quant), core.errors, core.telemetry; never core.plan or above.
"""

from core.model.gguf.files import GGUFModel, find_gguf, is_gguf

__all__ = ["GGUFModel", "find_gguf", "is_gguf"]
