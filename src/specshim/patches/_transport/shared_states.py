"""Captured states from a worker to the main process through shared host memory.

The worker (tensor-parallel rank 0, which always shares the main process's
host) copies a call's rows into a slab: one mapping of a file in
``/dev/shm``, pinned for the GPU's copy engine where CUDA allows it. It
replies with one small ``SharedStates`` descriptor. Unpickled in the main
process, the descriptor maps the same file and becomes the list of layers,
each a CPU tensor viewing the slab: no tensor is pickled, nothing lands on
the main process's GPU, and the states are copied once on their way out of
the worker instead of through ``torch.save``. This module is the worker's
side; ``handed_states`` is the main process's.

The layers are ``HandOver`` tensors. speculators clones every sequence's
slice of them (``h[a:b].clone().cpu()``); a ``HandOver`` answers such a clone
with a tensor of its own over exactly those rows of the slab, instead of a
copy into fresh memory (on an H200 host those copies took half of
``generate()``'s time). The caller gets an ordinary CPU tensor, with its own
storage of exactly its rows (``torch.save`` writes the same bytes as for a
clone), that nothing else writes to. The one difference: its storage cannot
be resized.

Lifetime, the rule everything here relies on:

* A slab holds one call's states and is the caller's until the main process
  lets go of every tensor over it (the layers, their slices and what their
  clones returned): then a finalizer stamps the slab's header "released".
* The worker writes only into a slab that is new or released. A call that
  finds none free gets a new slab; a free slab too small for the call is
  retired, and the next descriptor tells the main process to drop its mapping.
  Where the caller keeps the states of ``MAX_SLABS`` calls alive, the next
  calls' states travel as numpy arrays instead (a warning says so once).
* Each fetch stamps a generation number into the slab's header after the
  copies are complete; a descriptor attaches only to the generation it names,
  so a stale one refuses to be read instead of returning other rows.
* The main process unlinks a slab's file once it has mapped it (the worker
  mapped it first), so a killed run leaves nothing in ``/dev/shm``; a worker
  unlinks whatever the main process never attached when it exits, and the
  main process removes what a killed worker left (``handed_states.forget``).
  Where both were killed at once, a later run's worker removes the files no
  process holds a lock on (``host_slabs.sweep_stale``).
* A fork of the main process while it holds rows over slabs makes those
  slabs its own memory first (``handed_states._before_fork``): parent and
  child then have copy-on-write copies, as of any other memory, and the slab
  goes back to its worker. A release comes only from the process that
  attached the slab, so a child letting go of its copies releases nothing.

Making a slab costs time on the call's path: reserving it in ``/dev/shm`` and
pinning it took about 0.5 s a GB on an H200 host, and ``extract``, whose
writer holds the states of the calls it is still writing, needs a slab for
each of them until the first are written (kimi-width: ``generate()`` took
8.0 s inside ``extract`` against 4.5 s alone). So where the states come from
a GPU, a call that found no free slab of its size has the next one made
beside the GPU's work, on a thread of its own (``host_slabs.Ahead``): the
next call takes it. At most one is made ahead at a time, and only while the caller
holds every slab that fits; it costs the space of one slab more. Where the
caller says before the first call how many rows its calls capture at most
(``SPECSHIM_SLAB_ROWS``, ``extract`` does: its first batch's; and how many
slabs, ``SPECSHIM_SLABS``), the slabs are made on that thread as soon as the
capture is set up (``prepare``), beside vLLM's KV-cache allocation and
warm-up instead of on the first calls' path; a call that finds none of them
made yet waits for the next rather than making its own.

Where no slab can be had (``/dev/shm`` missing or too small: a container's
default is 64 MiB; or ``SPECSHIM_SHM_MIB``, the most the slabs may take), the
states travel as numpy arrays instead, which vLLM's message queue sends out
of band, and the main process copies them into memory of its own before
handing them over (``handed_states.received``); a warning names the cause
and the cost once per worker.
"""

from __future__ import annotations

import atexit
import errno
import logging
import mmap
import os
import secrets
from typing import Any

from specshim._base import SHM_LIMIT, shm_limit
from specshim.patches._transport import host_slabs as _slabs
from specshim.patches._transport.slab import DIRECTORY, HEADER, PREFIX

logger = logging.getLogger(__name__)

MAX_SLABS = 8  # calls whose states the caller may hold before the fallback
_GROW = 1.25  # headroom, so slowly rising batch sizes do not retire slabs often
_COST = (
    "every byte of those states is copied twice more on the host (into vLLM's "
    "queue and out of it): on an H200, generate() ran at 0.23 of its speed "
    "with slabs (docs/gpu.md, 'In a container')"
)


def slab_size(nbytes: int) -> int:
    """The bytes of a new slab for a call whose states take ``nbytes``: its
    header and the call's rows, with headroom, in whole pages."""
    size = HEADER + int(nbytes * _GROW) + 1
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


class SharedStates:
    """Pickles as the instruction to map a worker's rows (see ``attach``)."""

    def __init__(
        self, path: str, generation: int, layers: Any, retired: Any = ()
    ) -> None:
        self.args = (
            path,
            generation,
            tuple((int(o), tuple(s), str(d)) for o, s, d in layers),
            tuple(retired),
        )

    def __reduce__(self) -> tuple[Any, ...]:
        from specshim.patches._transport.handed_states import attach

        return attach, self.args


class OwnedRows:
    """The fallback: rows as a numpy array of bytes (sent out of band by
    vLLM's message queue), copied into the main process's own memory and
    handed over from there like a slab's."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows.contiguous()

    def __reduce__(self) -> tuple[Any, ...]:
        from specshim.patches._transport.handed_states import received

        raw = self.rows.view(-1).view(_uint8()).numpy()
        return received, (raw, tuple(self.rows.shape), str(self.rows.dtype))


def _uint8() -> Any:
    import torch

    return torch.uint8


class HostRegion:
    """A worker's slabs (see the module docstring for who may write them and
    when)."""

    def __init__(self, directory: str = DIRECTORY) -> None:
        self.directory = directory
        self.prefix = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(4)}"
        self.slabs: list[_slabs.Slab] = []
        self.retired: list[str] = []  # closed since the last descriptor
        self.generation = 0
        self.pin_failed = False
        self.failure: str | None = None  # why the fallback is in use for good
        self.limit = shm_limit()  # bytes the slabs may take (None: no cap)
        self.warned: set[str] = set()  # the causes already logged
        self.ahead: _slabs.Ahead | None = None  # the next call's slab, being made
        self.make_ahead: bool | None = None  # None: where the states are pinned
        self.early_fetches = 0  # fetches answered by ``early_copies``
        atexit.register(self.close)
        removed, freed = _slabs.sweep_stale(directory)
        if removed:
            logger.info(
                "specshim: removed %d slab file(s) (%.0f MiB) a killed run left in %s",
                removed,
                freed / 2**20,
                directory,
            )

    def reserve(self, nbytes: int, pin: bool) -> _slabs.Slab | None:
        """A free slab of at least ``nbytes``, or None: this call's states
        take the fallback (``failure`` says why, where it is for good)."""
        if self.failure is not None:
            return None
        self._adopt_ahead(nbytes)
        free = [s for s in self.slabs if s.free()]
        fitting = [s for s in free if s.capacity >= nbytes]
        if fitting:
            slab = min(fitting, key=lambda s: s.capacity)
        else:
            if free:
                self._retire(min(free, key=lambda s: s.capacity))
            elif len(self.slabs) >= MAX_SLABS:
                self._full()
                return None
            slab = self._grow(slab_size(nbytes))
            if slab is None:
                return None
        if pin and not (slab.pinned or self.pin_failed):
            self.pin_failed = not slab.pin()
        ahead = pin if self.make_ahead is None else self.make_ahead
        if ahead:
            self._start_ahead(nbytes, slab, pin)
        return slab

    def prepare(self, nbytes: int, count: int, device: int | None) -> int:
        """Have ``count`` slabs for calls of ``nbytes`` made on a thread of
        their own (pinned on ``device`` where given), within ``MAX_SLABS`` and
        the cap; how many that is (0 where one is being made already)."""
        if self.ahead is not None or self.failure is not None:
            return 0
        size = slab_size(nbytes)
        room = MAX_SLABS - len(self.slabs)
        if self.limit is not None:
            room = min(room, (self.limit - self._taken()) // size)
        count = max(0, min(count, room))
        if count:
            paths = [self._new_path() for _ in range(count)]
            self.ahead = _slabs.Ahead(paths, size, device)
        return count

    def _start_ahead(self, nbytes: int, taken: _slabs.Slab, pin: bool) -> None:
        """Have the next call's slab made beside the GPU's work, where the
        caller holds every other slab that would fit (see the module
        docstring); within ``MAX_SLABS`` and the cap, one at a time."""
        if self.ahead is not None or any(
            s is not taken and s.capacity >= nbytes and s.free() for s in self.slabs
        ):
            return
        device = None
        if pin and not self.pin_failed:
            import torch

            device = torch.cuda.current_device()
        self.prepare(nbytes, 1, device)

    def _adopt_ahead(self, nbytes: int | None = None) -> None:
        """The slabs made ahead so far join the region. Where a call of
        ``nbytes`` finds none of the region's free slabs fitting while the
        thread still makes one, it waits for it: no longer than making it
        here would take. Without ``nbytes`` (closing), the thread is waited
        for to the end."""
        ahead = self.ahead
        if ahead is None:
            return
        wait = False
        while True:
            made, done = ahead.take(wait)
            self.slabs.extend(made)
            if done or (nbytes is not None and self._fitting(nbytes)):
                break
            wait = True
        if done:
            ahead.join()
            self.ahead = None
        self.pin_failed = self.pin_failed or ahead.pin_failed

    def _fitting(self, nbytes: int) -> bool:
        return any(s.free() and s.capacity >= nbytes for s in self.slabs)

    def stamp(self, slab: _slabs.Slab) -> int:
        """Mark ``slab`` as holding a new fetch's rows (after the copies)."""
        self.generation += 1
        slab.stamp(self.generation)
        return self.generation

    def take_retired(self) -> tuple[str, ...]:
        retired, self.retired = tuple(self.retired), []
        return retired

    def _taken(self) -> int:
        return sum(slab.base.numel() for slab in self.slabs)

    def _new_path(self) -> str:
        return os.path.join(self.directory, f"{self.prefix}-{secrets.token_hex(4)}")

    def _grow(self, size: int) -> _slabs.Slab | None:
        if self.limit is not None and self._taken() + size > self.limit:
            return self._refused(
                "limit",
                f"{SHM_LIMIT}={self.limit >> 20} leaves no room for a slab of "
                f"{size / 2**20:.0f} MiB of captured states",
                lasting=self.limit == 0,
            )
        path = self._new_path()
        try:
            slab = _slabs.Slab(path, size)
        except OSError as exc:
            return self._refused(
                "space",
                f"{self.directory} could not hold {size / 2**20:.0f} MiB of "
                f"captured states ({exc.strerror or exc}); a container needs a "
                "larger /dev/shm (docker run --shm-size=16g, or --ipc=host)",
                lasting=not self.slabs and exc.errno != errno.ENOSPC,
            )
        self.slabs.append(slab)
        return slab

    def _refused(self, kind: str, cause: str, lasting: bool = False) -> None:
        """No new slab: this call's states take the fallback, for good where
        ``lasting`` (no shared memory at all). Each kind of cause is logged
        once, with the first call's figures."""
        if lasting:
            self.failure = cause
        if kind not in self.warned:
            self.warned.add(kind)
            logger.warning(
                "specshim: %s; the states of calls that find no free slab travel "
                "through vLLM's message queue instead: %s",
                cause,
                _COST,
            )
        return None

    def _retire(self, slab: _slabs.Slab) -> None:
        self.slabs.remove(slab)
        self.retired.append(slab.path)
        slab.close()

    def _full(self) -> None:
        self._refused(
            "held",
            f"the caller still holds the captured states of {MAX_SLABS} "
            "generate() calls (each keeps its slab)",
        )

    def close(self) -> None:
        """Drop every slab (files nobody attached are removed)."""
        self._adopt_ahead()
        for slab in self.slabs:
            slab.close()
        self.slabs = []


def region_of(worker: Any) -> HostRegion:
    """The worker's slabs, made on first use (they live as long as it does)."""
    region = getattr(worker, "_specshim_region", None)
    if region is None:
        region = worker._specshim_region = HostRegion()
    return region
