"""The runtime: CGOPipe as data, run by executors, driven by the engine.

The schedule (a step's task graph), the pipeline (what each task does and the buffers they share),
the executors (sequential, threaded, CUDA; the simulator replays the same graph with HRM costs),
request batching (Algorithm 2) and the engine's step loop.
Imports: `core.errors`, `core.telemetry`, `core.model`, `core.plan` and itself — never `core.io`
or `app` (tests/test_layering.py checks it).
"""
