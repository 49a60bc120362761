"""Quantized expert weights: formats, packing, compute kernels, the quantized cache and GGUF in.

A weight format (bf16, int8 per output channel, int4 group-wise, gpt-oss MXFP4, GGUF block formats)
is a property of a layer's flat buffer (`core.model.weights`): the packed integers and their scales
sit together in the expert region, so CGOPipe's pages carry quantized bytes and whoever computes
(the CPU kernels, or the device after dequantizing into a scratch buffer) expands them there.

Modules: `formats` (what a format stores and how many bytes a weight costs; float references for
quantize/dequantize), `blocks` (GGUF and MXFP4 block formats decoded with torch), `experts` (the
routed experts of one layer held quantized, with a kernel and a dequantize backend), `cache` (the
quantized checkpoint written once into the user cache), `gguf_model` (a GGUF file as a checkpoint).
Imports: torch, `core.model.spec`, `core.errors`, `core.telemetry`; never core.plan or above.
"""
