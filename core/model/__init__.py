"""The model: what a checkpoint is and how one decoder layer computes (spec, families, weights, layers, KV cache,
sampling, the demo). Imports: `core.errors`, `core.telemetry` and itself only (tests/test_layering.py checks it).
"""
