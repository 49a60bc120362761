"""Numbers the runtime's code and the planner's model of it must agree on, in one place, torch-free: the
model's kernels, core.plan and core.runtime all import them from here.
"""

FUSED_MAX_TOKENS = 128  # an accelerator's expert call of more tokens takes grouped_mm where it runs (dense weights)
# the fused expert path's torch form (core.model.fused_moe): experts' matrices gathered per chunk of blocks, at most
# this many bytes with their dequantizing temporaries — a decode step's blocks in one chunk, bounded memory beyond
FUSED_CHUNK_BYTES = 64 << 20


def fused_block_rows(pairs: int, experts: int) -> int:
    """The torch form's block rows (BM): about an expert's mean load (fewer gathers of one expert's weights),
    16 to 256 rows."""
    mean = -(-pairs // max(1, min(experts, pairs)))
    return min(256, max(16, 1 << (mean - 1).bit_length()))


def fused_slots(pairs: int, experts: int, block_rows: int) -> int:
    """S: the padded slots the block alignment of `pairs` pairs over `experts` experts needs at most — every
    pair, plus up to BM − 1 of padding for each expert that can get a pair — rounded up to a whole block."""
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


# A CPU prefill runs each layer on a chunk of its call at a time: whole prompts together through the token mixer
# (one longer prompt alone), any tokens through the FFN, each chunk's output written back over its rows. Whole, a
# call's intermediates pass glibc's largest mmap threshold (32 MB) and are mapped fresh and page-faulted at every
# layer: with the FFN whole the demo's first wave of 200 prompts (15,400 tokens) took 2.0-2.1 s, 1.03-1.04 s with
# it in chunks; with the mixer whole as well the 784M's 256-prompt call (19,705 tokens) faulted in 5 GB a call and
# took 21.5-25.9 s against 16.6-18.4 s with both in chunks — and its speed hung on whether the process's heap
# happened to hold that much free memory. A device's caching allocator reuses its blocks: there the call stays
# whole (core.runtime.pipeline). The planner prices a call by its chunks (core.plan.cpu_cost).
PREFILL_CHUNK_BYTES = 16 << 20  # a chunk's widest fp32 intermediate: half the threshold (routing is uneven)
PREFILL_CHUNK_TOKENS, PREFILL_CHUNK_LEAST = 2048, 256  # at most (GEMMs this tall gain nothing more), at least
# ... but each chunk reads the layer's routed experts again. Where they are large a chunk sized by its activations
# alone made the prefill weight-bound: Mixtral 8x7B's 409-token chunks re-read 2.8 GB of experts 55 times a call,
# and the CPU-only plan's prefill ran slower per token than its own decode, whose expert batch reads them once
# for 2,044 tokens (issue 46, defect 16). A chunk grows until the expert weights it re-reads per token are at most
# this many times the elements of its widest activation a token: a weight read costs a fraction of an activation
# mapped fresh (the 784M re-read 22 times as many weights as that and ran faster chunked; every bundled preset
# re-read 96-760 times as many).
PREFILL_REREAD = 64


def prefill_chunk(D: int, q: int, kv: int, I: int, Is: int, Id: int, E: int, k: int) -> int:
    """Tokens of a CPU prefill chunk for a model of these sizes: its widest fp32 intermediate a token within
    PREFILL_CHUNK_BYTES, unless the routed experts it re-reads call for a taller one (PREFILL_REREAD)."""
    widest = 4 * max(D + q + 2 * kv, 2 * max(Is, Id), 2 * I * min(1.0, k / max(1, E)))
    reread = 3 * D * I * E / (PREFILL_REREAD * widest / 4)
    return int(max(PREFILL_CHUNK_LEAST, min(PREFILL_CHUNK_TOKENS, max(PREFILL_CHUNK_BYTES // widest, reread))))
