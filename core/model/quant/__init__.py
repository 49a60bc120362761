"""Quantized weights: formats, packing, kernels, the quantized cache. Packed integers and scales sit in a layer's
flat buffer (`core.model.weights`), so pages carry quantized bytes and whoever computes expands them.
"""
