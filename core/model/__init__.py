"""The model: what a checkpoint is and how one decoder layer computes.

ModelSpec and the family registry (one module per family under `families/`: config translation and
weight names), safetensors reading, the per-layer flat weight buffer cut into pages, the layers
(norms, RoPE, attention, the MoE FFN), the KV cache, sampling and the demo model.
Imports: `core.errors`, `core.telemetry` and itself only — never `core.plan`, `core.runtime`,
`core.io` or `app` (tests/test_layering.py checks it).
"""
