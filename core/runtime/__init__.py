"""The runtime: CGOPipe as data (a step's task graph), run by executors, driven by the engine's step loop.
Imports: `core.errors`, `core.telemetry`, `core.model`, `core.plan` and itself — never `core.io` or `app`.
"""
