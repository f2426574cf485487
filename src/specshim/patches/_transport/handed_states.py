"""The main process's side of ``shared_states``: a worker's descriptor
mapped into the call's layers, and the clones of their slices handed over.

See ``shared_states`` for the slabs and the lifetime rule. ``attach`` maps
a slab (once per slab: the mapping is kept while its worker keeps the slab)
and returns each layer as a ``HandOver`` tensor viewing its rows. A
``_Lease`` is one fetch's hold on its slab: every tensor handed out keeps it
alive, and when the last one goes its finalizer writes the fetch's
generation into the slab's "released" word, which is what lets the worker
write there again.

A fork would break that rule: the child inherits the caller's tensors over
the same shared pages, so either side's in-place writes show in the other,
a release lets the worker overwrite what the other still reads, and a child
letting go of its copies would release rows the parent still holds. So at a
fork the slabs with rows held are first made this process's own memory
(``private_copy``: ordinary memory, copied on write as any other) and then
released, and a release only ever comes from the process that attached.
"""

from __future__ import annotations

import glob
import logging
import math
import mmap
import os
import threading
import weakref
from typing import Any

from specshim import _moved
from specshim._base import pid_alive
from specshim._closing import when_workers_gone
from specshim.patches._transport import private_copy
from specshim.patches._transport.slab import (
    DIRECTORY,
    HEADER,
    files_of,
    read_word,
    remove_unlocked,
    unlink_quietly,
)


def _dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name.rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name}")
    return dtype


class Unattached:
    """What a descriptor's layers become when the main process cannot map
    them: any use raises one line that says why (raising during unpickling
    would break vLLM's reply queue instead)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def _refuse(self, *_: Any) -> Any:
        from specshim._base import SpecShimError

        raise SpecShimError(self.reason)

    __getitem__ = __len__ = __iter__ = _refuse


logger = logging.getLogger(__name__)

_ATTACHED: dict[str, mmap.mmap] = {}  # path -> mapping, while its worker keeps it
# path -> an open descriptor of the (unlinked) file, to map it anew at a fork
_FILES: dict[str, int] = {}
# The releases of slab leases whose rows may still be held (a dead one holds
# nothing: its mapping goes with the last lease over it).
_HELD: list[weakref.finalize] = []
# Held by a fork's handler: no lease is made and no slab attached or let go
# meanwhile (its copies let other threads run). Reentrant: a generator
# collected meanwhile lets its slabs go from the garbage collector, on
# whichever thread allocated, the handler's own included.
_FORKING = threading.RLock()


def attach(path: str, generation: int, layers: Any, retired: Any = ()) -> list[Any]:
    """Main process: the call's layers, each a ``HandOver`` viewing its rows
    (``layers`` holds each one's offset, shape and dtype)."""
    for old in retired:
        _let_go(old)  # views still held keep the memory alive
    mapping = _ATTACHED.get(path)
    if mapping is None:
        mapping = _map(path)
        if isinstance(mapping, Unattached):
            return [mapping for _ in layers]
    found = read_word(mapping, 0)
    if found != generation:
        stale = Unattached(
            f"the captured states in {path} are of fetch {found}, not of fetch "
            f"{generation}: they were overwritten before this process read them "
            "(a specshim bug; please report it)"
        )
        return [stale for _ in layers]
    lease = _Lease.of_slab(mapping, generation)
    return [lease.layer(offset, shape, dtype) for offset, shape, dtype in layers]


def received(raw: Any, shape: Any, dtype: str) -> Any:
    """Main process: the fallback's rows as a ``HandOver`` over a copy this
    process owns.

    ``raw`` is whatever vLLM's message queue handed ``pickle.loads`` for the
    out-of-band buffer, and it is never the caller's to keep: a reply that
    fits one chunk of the queue is read in place from the queue's
    shared-memory ring (writable memory that the worker writes the next
    messages into: rows handed out over it changed a few calls later), a
    larger one arrives as zmq frames (read-only), and an older vLLM sends it
    in band. Who owns the memory cannot be told from the buffer, so it is
    always copied before anything is handed out."""
    copy = raw.copy()
    _moved.add(queued_bytes=copy.nbytes)
    return _Lease(copy).layer(0, shape, dtype)


def _map(path: str) -> Any:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        return Unattached(
            f"the captured states are in {path}, which this process cannot "
            f"open ({exc.strerror}): tensor-parallel rank 0 must run on the "
            "same host as the process that calls generate(); "
            "SPECSHIM_DISABLE=state-transport sends them through vLLM's "
            "RPC queue instead (slow)"
        )
    try:
        mapping = mmap.mmap(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    forget(())  # workers that exited without their generator's close()
    with _FORKING:  # attach maps only a path it does not hold
        _ATTACHED[path], _FILES[path] = mapping, fd
    _moved.add(slabs=1)
    unlink_quietly(path)
    return mapping


def forget(pids: Any) -> None:
    """Drop this process's mappings of the slabs of the workers ``pids``
    (their generator was closed or collected: none of them is written again).
    Tensors still held keep their own slab mapped until they go; the rest is
    unmapped here, not whenever a later generator maps a slab."""
    gone = set(pids)
    sweeps = set()  # (pid, directory): each swept once, however many slabs
    for path in list(_ATTACHED):
        owner = _owner_pid(path)
        if owner in gone or not pid_alive(owner):
            _let_go(path)
            sweeps.add((owner, os.path.dirname(path)))
    for pid in gone:  # slabs made before any call (``prepared-slabs``)
        if not pid_alive(pid):
            sweeps.add((pid, DIRECTORY))
    for pid, directory in sweeps:
        _sweep(pid, directory)


def _sweep(pid: int, directory: str = DIRECTORY) -> None:
    """Remove the worker ``pid``'s files that nobody attached: a worker that
    was killed cannot remove the slabs it made ahead for calls that never
    came (``host_slabs.Ahead``)."""
    for leftover in glob.glob(files_of(pid, directory)):
        remove_unlocked(leftover)  # a lock held: another namespace's pid


when_workers_gone(forget)  # a closed generator's slabs are unmapped


def _let_go(path: str) -> None:
    """Forget this process's mapping of ``path`` and close its descriptor
    (never while a fork takes the held slabs over)."""
    with _FORKING:
        _drop(path)


def _drop(path: str) -> None:
    _ATTACHED.pop(path, None)
    fd = _FILES.pop(path, None)
    if fd is not None:
        os.close(fd)


def _owner_pid(path: str) -> int:
    """The worker pid in ``.../specshim-states-PID-TOKEN-TOKEN``."""
    return int(os.path.basename(path).split("-")[2])


def _release(mapping: Any, generation: int, attached_by: int) -> None:
    """The main process holds nothing over this fetch's slab any more (a
    forked child's copies never release what its parent holds)."""
    if os.getpid() != attached_by:
        return
    try:
        mapping[8:16] = generation.to_bytes(8, "little")
    except ValueError:  # the mapping was closed: nobody will reuse it
        pass


class _Lease:
    """Memory the main process alone holds, as a numpy array of bytes that
    every tensor handed out keeps alive (through the numpy views under their
    storages): a fetch's slab (released to the worker when the last tensor
    goes), or the fallback's received buffer (nothing to release)."""

    def __init__(self, array: Any, floor: int = 0) -> None:
        self.array, self.floor = array, floor  # rows start at ``floor``
        self.address = array.ctypes.data
        self.taken: list[tuple[int, int]] = []  # byte ranges handed out

    @classmethod
    def of_slab(cls, mapping: Any, generation: int) -> _Lease:
        import numpy as np

        with _FORKING:
            lease = cls(np.frombuffer(mapping, dtype=np.uint8), HEADER)
            release = weakref.finalize(
                lease.array, _release, mapping, generation, os.getpid()
            )
            release.atexit = False
            _HELD[:] = [held for held in _HELD if held.alive]
            _HELD.append(release)
        return lease

    def tensor(self, start: int, nbytes: int, dtype: Any, shape: Any) -> Any:
        import torch

        raw = torch.from_numpy(self.array[start : start + nbytes])
        return raw.view(dtype).view(*shape)

    def layer(self, offset: int, shape: Any, dtype: str) -> Any:
        kind = _dtype(dtype)
        nbytes = math.prod(int(size) for size in shape) * kind.itemsize
        rows = self.tensor(self.floor + offset, nbytes, kind, shape)
        rows = rows.as_subclass(hand_over_class())
        rows._specshim_lease = self
        return rows

    def take(self, view: Any) -> Any | None:
        """The rows under ``view`` as a tensor of their own, or None where they
        are not a contiguous range no earlier clone was given."""
        if not view.is_contiguous() or view.numel() == 0:
            return None
        start = view.data_ptr() - self.address
        end = start + view.numel() * view.element_size()
        if start < self.floor or end > self.array.size:
            return None
        if any(start < b and a < end for a, b in self.taken):
            return None
        self.taken.append((start, end))
        return self.tensor(start, end - start, view.dtype, view.shape)


def _before_fork() -> None:
    """Make every slab with rows still held this process's own memory, then
    release it to its worker (see the module docstring). Where the memory
    cannot be copied, the slab stays shared and is never released: the
    worker never writes it again, and a warning says that in-place writes
    show on both sides of the fork."""
    _FORKING.acquire()  # released after the fork, in parent and child
    held: dict[int, tuple[mmap.mmap, int]] = {}
    for release in _HELD:
        detached = release.detach()  # the parent's rows never release it now
        if detached is not None:
            mapping, generation, _ = detached[2]
            held[id(mapping)] = (mapping, generation)
    _HELD.clear()
    for mapping, generation in held.values():
        path = next((p for p, m in _ATTACHED.items() if m is mapping), None)
        try:
            _take_over(mapping, generation, path)
        except Exception as exc:  # noqa: BLE001 - a fork must go on
            logger.warning(
                "specshim: a fork while generate()'s results are held, and their "
                "memory could not be copied for this process alone (%s): parent "
                "and child share it, so do not write to those tensors in place",
                exc,
            )


def _take_over(mapping: mmap.mmap, generation: int, path: str | None) -> None:
    """One held slab: this process's own memory, then mapped anew and
    released where its worker may write it again."""
    private_copy.make_private(mapping, _FILES.get(path) if path else None)
    if path is None:
        return  # retired, or its generator closed: never written again
    try:
        _ATTACHED[path] = mmap.mmap(_FILES[path], 0)
    except OSError:
        _drop(path)  # never released: its worker does without it
    else:
        _release(_ATTACHED[path], generation, os.getpid())


def _after_fork() -> None:
    _FORKING.release()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork
)


def _hand_over_class() -> Any:
    import torch

    class HandOver(torch.Tensor):
        """A layer of a fetch's slab (see the module docstring): its slices
        stay ``HandOver``; a clone of a slice gets the slice's own rows."""

        @classmethod
        def __torch_function__(
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            lease = getattr(args[0], "_specshim_lease", None) if args else None
            if func is torch.Tensor.clone and lease is not None and _plain(kwargs):
                owned = lease.take(args[0])
                if owned is not None:
                    return owned
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            if func is torch.Tensor.__getitem__ and lease is not None:
                out = out.as_subclass(HandOver)
                out._specshim_lease = lease
            return out

        def __reduce_ex__(self, protocol: Any) -> Any:  # pickles as a plain tensor
            with torch._C.DisableTorchFunctionSubclass():
                return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    return HandOver


def _plain(kwargs: dict[str, Any]) -> bool:
    import torch

    memory_format = kwargs.get("memory_format", torch.preserve_format)
    return set(kwargs) <= {"memory_format"} and memory_format in (
        torch.preserve_format,
        torch.contiguous_format,
    )


_HAND_OVER: list[Any] = []


def hand_over_class() -> Any:
    """``HandOver``, built once (torch is imported only where it is used)."""
    if not _HAND_OVER:
        _HAND_OVER.append(_hand_over_class())
    return _HAND_OVER[0]
