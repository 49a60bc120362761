"""Large CPU weights on transparent huge pages, where Linux gives them on request (THP "madvise", as Debian
and Ubuntu ship it; "always" gives them anyway).

A decode step at B = 1 streams each layer's weights once, front to back. On 4 KB pages every 4 KB of that
stream is a new TLB entry and a point where the hardware prefetcher stops and starts again; on 2 MB pages
one Zen 5 core read the same bytes at 26-27 GB/s where it read 19-22 (a plain sequential read and the bf16
expert kernel alike). llama.cpp gets them without asking: it reads its weights from the page cache, which
holds a GGUF in large folios.
Anywhere else (another OS, no madvise, a tensor under one huge page) `empty` is torch.empty.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE = 2 << 20  # x86-64's and most arm64 kernels' PMD page


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype) whose whole 2 MB stretches lie on huge pages where the OS allows: a private
    anonymous mapping (shared memory has its own THP switch, usually off) from a 2 MB boundary. Only the
    whole huge pages are asked for, so the tail and the unused head stay 4 KB pages, never touched: no
    memory held beyond the tensor's bytes. The mapping lives as long as the tensor (torch.frombuffer)."""
    n = math.prod(shape) * dtype.itemsize
    if n < HUGE or not (hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")):
        return torch.empty(shape, dtype=dtype)
    m = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE)
    raw = torch.frombuffer(m, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, skip, n // HUGE * HUGE)
    except OSError:  # THP "never", or a kernel without it: small pages, as torch.empty's
        pass
    return raw[skip:skip + n].view(dtype).view(shape)
