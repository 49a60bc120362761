"""core.model.cpu.hugepages: weights on transparent huge pages where Linux gives them, plain tensors elsewhere."""

import dataclasses
import gc
import mmap
from pathlib import Path

import pytest
import torch

from core.model.cpu import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _smaps(addr: int, field: str) -> int:
    """`field` (kB: "Rss", "AnonHugePages") of the mapping holding `addr` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == field + ":":
            return int(line.split()[1])
    return 0


def test_a_large_tensor_holds_its_values_after_the_mapping_object_is_gone():
    t = hugepages.empty((3, 5 << 20), torch.bfloat16)  # 30 MB
    assert t.shape == (3, 5 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE == 0
    want = torch.arange(t.numel(), dtype=torch.float32).remainder_(251).to(torch.bfloat16).view(t.shape)
    t.copy_(want)
    gc.collect()  # only the tensor keeps the mapping alive
    assert torch.equal(t, want)
    assert torch.equal(t[2, -7:], want[2, -7:])


def test_a_tensor_under_one_huge_page_is_plain_torch_memory():
    t = hugepages.empty((1000, 1000), torch.float16)  # 2,000,000 bytes < 2 MiB
    assert t.shape == (1000, 1000) and t.dtype == torch.float16
    t.fill_(1.5)
    assert float(t.double().sum()) == 1.5e6


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_the_whole_2mb_stretches_lie_on_huge_pages():
    t = hugepages.empty((9 << 20,), torch.uint8)  # four whole huge pages and a 1 MB tail
    t.fill_(7)
    kb = _smaps(t.data_ptr(), "AnonHugePages")
    # the kernel may fall short of free huge pages; it gives none at all only when madvise was not honoured
    assert 0 < kb <= 8 << 10, kb
    assert int(t[-1]) == 7


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_a_head_left_unwritten_before_huge_from_holds_no_memory():
    """A layer buffer whose dense head a GGUF load never fills (its projections are held as blocks elsewhere):
    huge pages start at the experts, so the head costs nothing resident (peak RAM 1.09x, not 1.14x, a file)."""
    head = 3 << 20
    t = hugepages.empty((head + (8 << 20),), torch.uint8, huge_from=head)
    assert (t.data_ptr() + head) % hugepages.HUGE == 0
    t[head:].fill_(5)  # the experts written, the head not
    assert _smaps(t.data_ptr(), "AnonHugePages") == 0  # the head's own 4 KB pages: none of them huge
    assert _smaps(t.data_ptr() + head, "AnonHugePages") > 0
    rss = _smaps(t.data_ptr(), "Rss")
    assert rss < 512, rss  # of the 3 MB head: untouched pages only


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no madvise(MADV_HUGEPAGE) on this OS")
def test_a_layer_buffer_asks_huge_pages_from_its_experts_on():
    from core.model.weights import LayerLayout
    from core.plan.presets import resolve_spec

    small = dataclasses.replace(resolve_spec("mixtral-8x7b"), num_layers=1, hidden_size=512, expert_intermediate=1024, num_experts=4,
                                num_heads=8, num_kv_heads=2, head_dim=64, vocab_size=256)
    layout = LayerLayout.for_spec(small, 0, None, torch.bfloat16)
    flat = layout.buffer(torch.bfloat16)
    experts = -(-layout.expert_start * 2 // 4096) * 4096  # the first page holding expert bytes
    assert flat.data_ptr() % 4096 == 0 and (flat.data_ptr() + experts) % hugepages.HUGE == 0
