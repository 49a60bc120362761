"""The planner: the machine, the hierarchical roofline model (HRM), and the policy it chooses (README's module table).
Imports: `core.errors`, `core.telemetry`, `core.model` and itself — never `core.runtime`, `core.io` or `app`
(tests/test_layering.py checks it).
"""
