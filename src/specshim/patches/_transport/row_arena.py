"""Memory the main process puts served rows back into, used again once the
caller lets go of it (``prefix_rows.stitch``).

With the prefix cache on, a sequence served its first blocks is its served
rows and its computed tail, joined into storage of its own: every call
writes about as many bytes as its sequences hold (640 MB for 32 sequences
of a 1,600-token Llama 1.2B sample). Fresh memory is mapped in page by page
as it is first written, and returned to the kernel when freed: on an H100
host those joins ran at 2.7 GB/s under cProfile (1.87 s of a run's 5.1 s in
``generate()``), where the run without the cache hands over the slab's rows
with no copy at all.

So the joins go into a few anonymous mappings that stay mapped (``Arena``),
under the slabs' lifetime rule (``shared_states``): a mapping is one call's
and the caller's until the main process lets go of every tensor over it
(each with storage of exactly its rows, as ``torch.save`` wants); only then
is it written again. A call that finds none free, where ``REGIONS`` are
held, joins into fresh memory instead, which is the caller's alone too.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from typing import Any

from specshim._base import stitch_regions
from specshim.patches._transport.handed_states import _Lease

REGIONS = 4  # mappings kept; a caller holding more calls gets fresh memory
ALIGN = 64  # each tensor's first byte, for the copies' vector loads
_GROW = 1.25  # headroom, so slowly rising call sizes do not remap often


def regions() -> int:
    """``REGIONS``, or ``SPECSHIM_STITCH_REGIONS`` where set (0: none, fresh
    memory); a value that is no whole number is refused
    (``_base.stitch_regions``)."""
    chosen = stitch_regions()
    return REGIONS if chosen is None else chosen


class _Region:
    """One anonymous mapping, free or lent to one call."""

    def __init__(self, size: int) -> None:
        # Private: a forked child writes its own copy of the pages, never
        # rows this process handed out (and THP applies, as it does not to
        # shared memory by default).
        self.mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        advise = getattr(mmap, "MADV_HUGEPAGE", None)
        if advise is not None:
            try:  # fewer, larger faults on first use where the kernel allows it
                self.mapping.madvise(advise)
            except OSError:
                pass
        self.size = size
        self.lent = False

    def release(self) -> None:
        self.lent = False  # the last tensor over it is gone


class Arena:
    """The process's regions; ``lease`` lends one to a call."""

    def __init__(self) -> None:
        self.regions: list[_Region] = []
        self.lock = threading.Lock()  # a finalizer may run on another thread

    def lease(self, nbytes: int) -> Joins | None:
        """Room for ``nbytes`` of joined rows, or None (join into fresh
        memory): a free region that holds them, else a new one while fewer
        than ``regions()`` are kept (a free one too small is replaced)."""
        if nbytes <= 0:
            return None
        with self.lock:
            free = [r for r in self.regions if not r.lent]
            region = next((r for r in free if r.size >= nbytes), None)
            if region is None:
                if len(self.regions) >= regions() and free:
                    self.regions.remove(free[0])  # too small: unmapped when unused
                if len(self.regions) >= regions():
                    return None
                size = -(-int(nbytes * _GROW) // mmap.PAGESIZE) * mmap.PAGESIZE
                region = _Region(size)
                self.regions.append(region)
            region.lent = True
        try:
            return Joins(region)
        except BaseException:
            region.lent = False  # nothing was handed out over it
            raise

    def drop_free(self, _pids: Any = None) -> None:
        """Unmap the regions no caller holds (a generator closed: its calls'
        joins are not coming back); those still held stay until reused."""
        with self.lock:
            self.regions = [r for r in self.regions if r.lent]


class Joins:
    """One call's hold on a region: tensors carved from it in order. When
    every one of them is gone (and this object), the region is free again."""

    def __init__(self, region: _Region) -> None:
        import numpy as np

        array = np.frombuffer(region.mapping, dtype=np.uint8)
        # Every tensor handed out keeps ``array`` alive (numpy keeps a view's
        # base, and stops at an array whose base is no array: the mapping).
        weakref.finalize(array, region.release).atexit = False
        self.lease = _Lease(array)
        self.region, self.size = region, region.size
        self.used = 0

    def empty(self, rows: int, like: Any) -> Any | None:
        """An uninitialised ``rows`` x ``like.shape[1:]`` tensor of
        ``like.dtype`` with storage of its own in the region, or None where
        the region is full."""
        import math

        shape = (rows, *like.shape[1:])
        nbytes = math.prod(shape) * like.element_size()
        start = -(-self.used // ALIGN) * ALIGN
        if start + nbytes > self.size:
            return None
        self.used = start + nbytes
        return self.lease.tensor(start, nbytes, like.dtype, shape)


_ARENA: list[Arena] = []


def arena() -> Arena:
    """This process's ``Arena``, made on first use; its free regions go when
    a generator's workers do (``specshim.close``)."""
    if not _ARENA:
        from specshim._closing import when_workers_gone

        _ARENA.append(Arena())
        when_workers_gone(_ARENA[0].drop_free)
    return _ARENA[0]
