"""The model: what a checkpoint is and how one decoder layer computes.

ModelSpec and the families, checkpoint reading, the paged weight buffers, the layers, the KV cache, sampling
and the demo model. Imports: `core.errors`, `core.telemetry` and itself only — never `core.plan`, `core.runtime`,
`core.io` or `app` (tests/test_layering.py checks it).
"""
