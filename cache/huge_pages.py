"""Tensors on transparent huge pages, for buffers a decode step reads end to end: a model's
weights and the K/V arena.

On 4 KiB pages such a read needs a TLB entry every 4 KiB (a page walk each, tens of thousands
a step) and the CPU's hardware prefetcher stops at every page boundary; on 2 MiB pages neither
happens, and one core's read of a large buffer runs measurably faster
(``experiments.bench_llm`` reports both bandwidths: ``details.decode_tokens_per_s.
read_bandwidth_by_reader_gbs``). Linux gives them to a mapping that asks
(``madvise(MADV_HUGEPAGE)``, honoured when ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``madvise`` or ``always``); elsewhere, or where the kernel has none free, the same mapping is
backed by ordinary pages and only the speed differs.
"""

from __future__ import annotations

import mmap
from math import prod

import torch

HUGE_PAGE = 2 << 20
"""x86-64's transparent huge page size: mappings are rounded up to whole ones."""


def zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed contiguous tensor in an anonymous mapping advised onto huge pages. Every page
    is touched here, so a machine short of memory fails now, as ``torch.zeros`` would, not at
    a later write. The tensor keeps the mapping alive (``torch.frombuffer`` holds it)."""
    numel = prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    m = mmap.mmap(-1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE,
                  flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux only
        m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8, count=nbytes).view(dtype).view(*shape)
    return t.zero_()  # the kernel's pages are zero already: this commits them
