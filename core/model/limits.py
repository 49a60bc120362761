"""Numbers the runtime's code and the planner's model of it must agree on, in one place (no torch here:
the planner imports it without loading torch). core/model is the lowest of core's packages, so the
model's kernels, the planner (core.plan) and the runtime (core.runtime) all import them from here.
"""

PADDED_MAX_TOKENS = 128  # an expert call of at most this many tokens runs every expert over a slot table
SCORE_BLOCK_ELEMS = 1 << 24  # score elements per block of the explicit prefill attention (64 MB in fp32)
LINEAR_CHUNK = 64  # Gated DeltaNet's prefill chunk
LOOKAHEAD = 2  # CGOPipe: CPU attention runs this many micro-batches ahead of the GPU
STAGING_ALIGN = 64  # bytes: each buffer of the runtime's pinned host staging arena starts at a multiple of this
# each tensor of a layer's flat weight buffer starts at a multiple of this many elements (bytes in a quantized
# layout): keeps every view aligned for vector loads; the planner counts the padding in what it page-locks
LAYOUT_ALIGN = 64
LOGIT_CHUNK_BYTES = 4 << 20  # a prepacked LM head's output rows at a time: memory malloc keeps, not fresh pages
