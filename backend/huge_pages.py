"""The weight panels and the KV cache a CPU decode step reads, in buffers backed by transparent huge pages.

Why: a decode step streams every layer's panels (for SmolLM2 about 190 MB: the Q4 panels and the
lm_head's Q8 ones) and every running sequence's KV blocks through 4 KB pages, tens of thousands of them a
step, so it keeps walking the page tables. Served, the response path's processes run between steps and
evict those TLB entries and page-table lines, and the step pays for that. Most panels are smaller than a
huge page (a layer's Q4 panels are 0.2-1 MB), so no allocator switch (torch's THP_MEM_ALLOC_ENABLE) puts
them on huge pages, and a sequence's KV blocks (12 KB each for SmolLM2) lie wherever the block manager
handed them out. One anonymous mapping, advised MADV_HUGEPAGE before any of it is written, with the
tensors laid out back to back, does. The results are the same bits; only where the bytes live changes.

`LLM_HUGE_PAGES=0` leaves both where torch puts them (A/B runs), as does a compiled decode
(`EngineConfig.compile`: its graph's per-layer regions refuse inputs that are views of one storage).
Where the kernel has no transparent huge pages the buffers are ordinary memory. A later
`Linear.repack()` (`.to()`) makes new panels of its own, and the buffer is then no longer read.
Figures: docs/performance.md (Q4 / Q8 weights and huge pages).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import os

import torch
from torch import nn

from backend.layers import Linear

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
CACHE_LINE = 64  # each tensor in a buffer starts on one
PANEL_NAMES = ("panels", "quant_panels")


def suits(device: torch.device, compiled: bool) -> bool:
    """Whether an engine on `device` places its panels and KV cache here: on CPU, and not for a compiled
    decode, whose graph takes both as inputs and whose per-layer regions refuse views of one storage."""
    return device.type == "cpu" and not compiled


def huge_pages_on() -> bool:
    """LLM_HUGE_PAGES is not 0 (read at each call) and this Python can advise huge pages."""
    return os.environ.get("LLM_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def place_panels(model: nn.Module) -> int:
    """Copies every CPU Linear's panels into one huge-page buffer and points the Linear at the copies;
    returns the bytes moved (0 when off or there are no panels)."""
    if not huge_pages_on():
        return 0
    slots = panel_slots(model)
    if not slots:
        return 0
    old = [getattr(linear, name) for linear, name in slots]
    copies = _views_in_one_buffer([(t.shape, t.dtype) for t in old])
    for (linear, name), panels, copy in zip(slots, old, copies, strict=True):
        copy.copy_(panels)
        setattr(linear, name, copy)
    total = sum(t.nbytes for t in copies)
    del old, panels  # the last references to the originals
    _return_freed_heap()
    logger.info("weight panels: %.0f MB in one huge-page buffer", total / 2**20)
    return total


KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # (k_cache, v_cache) per layer


def kv_caches(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype) -> KVCaches | None:
    """One zeroed (k_cache, v_cache) pair of `shape` per layer, all of them in one huge-page buffer, every
    page written now (so a pool too large for the machine fails at start, as torch.zeros would); None
    when huge pages are off."""
    if not huge_pages_on():
        return None
    caches = _views_in_one_buffer([(shape, dtype)] * (2 * num_layers))
    for cache in caches:
        cache.zero_()
    return list(zip(caches[0::2], caches[1::2], strict=True))


def _views_in_one_buffer(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Tensors of these (shape, dtype)s, back to back in one huge-page buffer, each on a cache line."""
    offsets, total = [], 0
    for shape, dtype in specs:
        total = -(-total // CACHE_LINE) * CACHE_LINE
        offsets.append(total)
        total += math.prod(shape) * dtype.itemsize
    buffer = huge_page_buffer(max(total, 1))
    return [
        buffer[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        for (shape, dtype), offset in zip(specs, offsets, strict=True)
    ]


def _return_freed_heap() -> None:
    """Gives the heap pages freed by the moved originals back to the kernel (glibc keeps them otherwise)."""
    with contextlib.suppress(AttributeError, OSError):  # (not glibc: nothing to give back this way)
        ctypes.CDLL(None).malloc_trim(0)


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
        logger.info("no transparent huge pages for this buffer: %s", e)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start)
