"""The weight panels a CPU decode step reads, moved into one buffer backed by transparent huge pages.

Why: a decode step streams every layer's panels (for SmolLM2 about 190 MB: the Q4 panels and the
lm_head's Q8 ones) through 4 KB pages, tens of thousands of them a step, so it keeps walking the page
tables. Served, the response path's processes run between steps and evict those TLB entries and
page-table lines, and the step pays for that. Most panels are smaller than a huge page (a layer's Q4
panels are 0.2-1 MB), so no allocator switch (torch's THP_MEM_ALLOC_ENABLE) puts them on huge pages.
One anonymous mapping, advised MADV_HUGEPAGE before any of it is written, with the panels copied in
back to back, does. The results are the same bits; only where the bytes live changes.

`LLM_HUGE_PAGES=0` leaves the panels where they are (A/B runs), as does a compiled decode
(`EngineConfig.compile`: its graph's per-layer regions refuse inputs that are views of one storage).
Where the kernel has no transparent huge pages the buffer is ordinary memory. A later
`Linear.repack()` (`.to()`) makes new panels of its own, and the buffer is then no longer read.
Figures: docs/benchmarking.md (twelfth pass).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import torch
from torch import nn

from backend.layers import Linear

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
PANEL_ALIGN = 64  # each panel starts on a cache line
PANEL_NAMES = ("panels", "quant_panels")


def huge_pages_on() -> bool:
    """LLM_HUGE_PAGES is not 0 (read at each call) and this Python can advise huge pages."""
    return os.environ.get("LLM_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def place_panels(model: nn.Module) -> int:
    """Copies every CPU Linear's panels into one huge-page buffer and points the Linear at the copies;
    returns the bytes moved (0 when off or there are no panels)."""
    if not huge_pages_on():
        return 0
    slots = panel_slots(model)
    offsets, total = [], 0
    for linear, name in slots:
        total = -(-total // PANEL_ALIGN) * PANEL_ALIGN
        offsets.append(total)
        total += getattr(linear, name).nbytes
    if total == 0:
        return 0
    buffer = huge_page_buffer(total)
    for (linear, name), offset in zip(slots, offsets, strict=True):
        panels = getattr(linear, name)
        copy = buffer[offset : offset + panels.nbytes].view(panels.dtype).view(panels.shape)
        copy.copy_(panels)
        setattr(linear, name, copy)
    logger.info("weight panels: %.0f MB in one huge-page buffer", total / 2**20)
    return total


def panel_slots(model: nn.Module) -> list[tuple[Linear, str]]:
    """(Linear, attribute name) of every CPU, contiguous panels tensor in the model, in module order."""
    return [
        (linear, name)
        for linear in model.modules()
        if isinstance(linear, Linear)
        for name in PANEL_NAMES
        if (t := getattr(linear, name)) is not None and t.device.type == "cpu" and t.is_contiguous()
    ]


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """(nbytes,) uint8, starting on a huge-page boundary of an anonymous mapping that was advised to use
    huge pages before any page of it was touched. The tensor keeps the mapping alive."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(mapping)) % HUGE_PAGE_BYTES
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError as e:  # a kernel built without transparent huge pages
        logger.info("no transparent huge pages for the weight panels: %s", e)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start)
