"""Numbers the runtime's code and the planner's model of it must agree on, in one place, torch-free."""

FUSED_MAX_TOKENS = 128  # an accelerator's expert call of more tokens takes grouped_mm where it runs (dense weights)
# the fused expert path's torch form (core.model.fused_moe): experts' matrices gathered per chunk of blocks, at most
# this many bytes with their dequantizing temporaries — a decode step's blocks in one chunk, bounded memory beyond
FUSED_CHUNK_BYTES = 64 << 20


def fused_block_rows(pairs: int, experts: int) -> int:
    """The torch form's block rows (BM): about an expert's mean load, 16 to 256 rows."""
    mean = -(-pairs // max(1, min(experts, pairs)))
    return min(256, max(16, 1 << (mean - 1).bit_length()))


def fused_slots(pairs: int, experts: int, block_rows: int) -> int:
    """S: every pair plus up to BM − 1 padding per expert that can get one, rounded up to a whole block."""
    s = pairs + min(experts, pairs) * (block_rows - 1)
    return -(-s // block_rows) * block_rows


SCORE_BLOCK_ELEMS = 1 << 24  # score elements per block of the explicit prefill attention (64 MB in fp32)
LINEAR_CHUNK = 64  # Gated DeltaNet's prefill chunk
LOOKAHEAD = 2  # CGOPipe: CPU attention runs this many micro-batches ahead of the GPU
STAGING_ALIGN = 64  # bytes: each buffer of the runtime's pinned host staging arena starts at a multiple of this
# each tensor of a layer's flat weight buffer starts at a multiple of this many elements (bytes in a quantized
# layout): keeps every view aligned for vector loads; the planner counts the padding in what it page-locks
LAYOUT_ALIGN = 64
LOGIT_CHUNK_BYTES = 4 << 20  # a prepacked LM head's output rows at a time: memory malloc keeps, not fresh pages


# A CPU prefill runs each layer a chunk of its call at a time: whole, a call's intermediates pass glibc's mmap
# threshold (32 MB) and are page-faulted fresh at every layer (a device's caching allocator reuses its blocks).
PREFILL_CHUNK_BYTES = 16 << 20  # a chunk's widest fp32 intermediate: half the threshold (routing is uneven)
PREFILL_CHUNK_TOKENS, PREFILL_CHUNK_LEAST = 2048, 256  # at most (GEMMs this tall gain nothing more), at least
# ... but each chunk re-reads the layer's routed experts: a chunk grows until the expert weights it re-reads per
# token are at most this many times its widest activation a token, or large experts make the prefill weight-bound.
PREFILL_REREAD = 64


def prefill_chunk(D: int, q: int, kv: int, I: int, Is: int, Id: int, E: int, k: int) -> int:
    """Tokens of a CPU prefill chunk for a model of these sizes: its widest fp32 intermediate a token within
    PREFILL_CHUNK_BYTES, unless the routed experts it re-reads call for a taller one (PREFILL_REREAD)."""
    widest = 4 * max(D + q + 2 * kv, 2 * max(Is, Id), 2 * I * min(1.0, k / max(1, E)))
    reread = 3 * D * I * E / (PREFILL_REREAD * widest / 4)
    return int(max(PREFILL_CHUNK_LEAST, min(PREFILL_CHUNK_TOKENS, max(PREFILL_CHUNK_BYTES // widest, reread))))
