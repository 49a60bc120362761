"""The model: what a checkpoint is and how one decoder layer computes (spec, families, weights, layers, KV cache,
sampling, the demo). Imports: itself, `core.errors`, `core.platform`, `core.telemetry`, `core.assets` only.
"""
