"""Quantized expert weights: formats, packing, compute kernels, the quantized cache and GGUF in.

A weight format is a property of a layer's flat buffer (`core.model.weights`): packed integers and
scales sit in the expert region, so pages carry quantized bytes and whoever computes expands them.
Imports: torch, `core.model.spec`, `core.errors`, `core.telemetry`; never core.plan or above.
"""
