"""GGUF in: a llama.cpp / Ollama / LM Studio model file read as an mlight checkpoint.

Its metadata becomes one of our families' configs; expert blocks stay the file's own bytes.
Imports: core.model (spec, families, weights, quant), core.errors, core.telemetry; never core.plan or above.
"""
