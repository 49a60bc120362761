"""GGUF in: a llama.cpp / Ollama / LM Studio model file read as an mlight checkpoint.

`files` finds the file and reads its metadata and tensor index; `arch` turns the metadata into one of
our families' configs and names each tensor's place in our layout; `load` fills the flat buffers, expert
blocks kept as the file's own bytes, and builds the tokenizer from the metadata.
Imports: core.model (spec, families, weights, quant), core.errors, core.telemetry; never core.plan or above.
"""
