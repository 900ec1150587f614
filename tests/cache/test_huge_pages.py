"""``cache.huge_pages``: zeroed tensors in a mapping advised onto huge pages, alive as long as
the tensor, and the arena held in one."""

import gc
from pathlib import Path

import pytest
import torch

from cache import huge_pages
from cache.token_arena import TokenArena


def _mapping_of(t: torch.Tensor) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``t``'s first byte."""
    addr, fields, inside = t.data_ptr(), {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end ...
                lo, hi = (int(x, 16) for x in head.split("-"))
                if inside:
                    break
                inside = lo <= addr < hi
            elif inside:
                k, _, v = line.partition(":")
                fields[k] = v.strip()
    return fields


def test_zeros_are_zero_writable_and_outlive_everything_but_the_tensor():
    t = huge_pages.zeros((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    gc.collect()  # the mapping is held by the tensor alone
    t.fill_(1.5)
    view = t[1:2]
    del t
    gc.collect()
    assert float(view.float().sum()) == 1.5 * 35
    assert huge_pages.zeros((0, 4), torch.float32).shape == (0, 4)


def _thp_on_request() -> bool:
    """Linux grants transparent huge pages to mappings that ask (``madvise`` mode)."""
    try:
        return "[madvise]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not _thp_on_request(), reason="no transparent huge pages on request here")
def test_the_mapping_is_advised_onto_huge_pages_and_so_is_the_arena():
    """madvise mode grants huge pages only to mappings that asked: the kernel marks them
    THP-eligible (ordinary torch tensors are not)."""
    assert _mapping_of(huge_pages.zeros((4 << 20,), torch.uint8)).get("THPeligible") == "1"
    arena = TokenArena(64, 2, 2, 16, 64, torch.float32)
    assert _mapping_of(arena.kv).get("THPeligible") == "1"
    assert not arena.kv.any()
