"""Beyond one process, on torch.distributed and torch's elastic launcher (no transport or scheduler of mlight's own).
Imports: like the rest of `core.runtime` — `core.model`, `core.plan`, `core.errors`, `core.telemetry`.
"""
