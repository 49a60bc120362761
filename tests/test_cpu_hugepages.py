"""core.model.cpu.hugepages: weights on transparent huge pages where Linux gives them, plain tensors elsewhere."""

import gc
from pathlib import Path

import pytest
import torch

from core.model.cpu import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kb(addr: int) -> int:
    """AnonHugePages of the mapping holding `addr` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
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
    kb = _anon_huge_kb(t.data_ptr())
    # the kernel may fall short of free huge pages; it gives none at all only when madvise was not honoured
    assert 0 < kb <= 8 << 10, kb
    assert int(t[-1]) == 7
