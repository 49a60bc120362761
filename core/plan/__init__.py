"""The planner: the machine, the hierarchical roofline model (HRM), and the policy it chooses.

Hardware (detect, presets, the probe), the HRM's per-task FLOPs and bytes, Policy and Prediction,
the policy search (pulp/CBC) and memory validation, and the bundled model presets.
Imports: `core.errors`, `core.telemetry`, `core.model` and itself — never `core.runtime`, `core.io`
or `app` (tests/test_layering.py checks it).
"""
