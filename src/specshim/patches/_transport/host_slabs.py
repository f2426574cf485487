"""A worker's slabs for the captured states, one by one: a slab (``Slab``:
a file in ``/dev/shm``, mapped, pinned for the GPU's copy engine) and the
thread that makes them beside the GPU's work or vLLM's start-up (``Ahead``).
``shared_states.HostRegion`` keeps them and decides which one a call may
write, and when."""

from __future__ import annotations

import glob
import logging
import mmap
import os
import threading
import time

from specshim.patches._transport.slab import (
    HEADER,
    PREFIX,
    create_locked,
    read_word,
    remove_unlocked,
    unlink_quietly,
)

logger = logging.getLogger(__name__)

STALE_S = 600  # an unlocked slab file untouched this long was left by a killed run


class Slab:
    """One file in ``/dev/shm``, mapped by the worker."""

    def __init__(self, path: str, size: int) -> None:
        import torch

        # Its lock is held as long as this process lives (the descriptor
        # stays open): a file no process holds a lock on was left by a killed
        # run. Held from before the file has its name.
        fd = create_locked(path)
        try:
            # tmpfs allocates lazily: reserve now, or a full /dev/shm kills the
            # worker with SIGBUS in the middle of a copy.
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            unlink_quietly(path)
            raise
        self.fd, self.path, self.mapping = fd, path, mapping
        self.base = torch.frombuffer(mapping, dtype=torch.uint8)
        self.generation = 0
        self.pinned = False

    @property
    def capacity(self) -> int:
        return self.base.numel() - HEADER

    def free(self) -> bool:
        """New, or released by the main process since its last fetch."""
        return self.generation == read_word(self.mapping, 8)

    def stamp(self, generation: int) -> None:
        self.generation = generation
        self.mapping[:8] = generation.to_bytes(8, "little")

    def pin(self) -> bool:
        import torch

        result = torch.cuda.cudart().cudaHostRegister(
            self.base.data_ptr(), self.base.numel(), 0
        )
        if getattr(result, "value", result) != 0:
            logger.warning(
                "specshim: could not pin %d MiB of shared memory for the captured "
                "states (cudaHostRegister: %s); copies go unpinned, more slowly",
                self.base.numel() >> 20,
                result,
            )
            return False
        self.pinned = True
        return True

    def close(self) -> None:
        """Unpin and drop the mapping; remove the file if nobody attached it."""
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.base.data_ptr())
        self.pinned = False
        self.base = self.mapping = None  # views elsewhere keep the memory alive
        unlink_quietly(self.path)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def sweep_stale(directory: str) -> tuple[int, int]:
    """Remove the slab files a killed run left in ``directory``: those no
    process holds a lock on (a worker holds one on each of its slabs while it
    lives; the main process removes a file as soon as it maps it), untouched
    for ``STALE_S`` (one being made this moment is not locked yet). How many
    went, and their bytes. Whether the owner lives is told by the lock, not
    by its pid: under ``--ipc=host`` the directory is shared with processes
    of other PID namespaces."""
    removed = freed = 0
    for path in glob.glob(os.path.join(glob.escape(directory), f"{PREFIX}-*")):
        try:
            if time.time() - os.stat(path).st_mtime < STALE_S:
                continue
        except OSError:
            continue  # gone meanwhile
        size = remove_unlocked(path)
        if size is not None:
            removed, freed = removed + 1, freed + size
    return removed, freed


class Ahead(threading.Thread):
    """Slabs made (and pinned on ``device``) on a thread of their own: the
    next call's, while the GPU computes this one, or those ``prepare`` was
    asked for. Where making one fails, the thread stops and nothing is said:
    the call that then makes its slab itself meets the same cause and says it
    once, as without this."""

    def __init__(self, paths: list[str], size: int, device: int | None) -> None:
        super().__init__(name="specshim-slab-ahead", daemon=True)
        self.paths, self.size, self.device = paths, size, device
        self.made: list[Slab] = []  # not taken by the region yet
        self.done = False
        self.pin_failed = False
        self.changed = threading.Condition()
        self.start()

    def take(self, wait: bool) -> tuple[list[Slab], bool]:
        """The slabs made since the last take (waiting for one more where
        ``wait`` and none is), and whether the thread has finished."""
        with self.changed:
            if wait:
                self.changed.wait_for(lambda: self.made or self.done)
            made, self.made = self.made, []
            return made, self.done

    def run(self) -> None:
        try:
            if self.device is not None and not self._on_device():
                return
            for path in self.paths:
                slab = self._make(path)
                if slab is None:
                    return
                with self.changed:
                    self.made.append(slab)
                    self.changed.notify_all()
        finally:
            with self.changed:
                self.done = True
                self.changed.notify_all()

    def _on_device(self) -> bool:
        try:
            import torch

            torch.cuda.set_device(self.device)  # a new thread starts on GPU 0
        except Exception:  # noqa: BLE001 - the calls make their own slabs
            logger.debug("specshim: making slabs ahead failed", exc_info=True)
            return False
        return True

    def _make(self, path: str) -> Slab | None:
        slab = None
        try:
            slab = Slab(path, self.size)
            if self.device is not None and not self.pin_failed:
                self.pin_failed = not slab.pin()
        except Exception:  # noqa: BLE001 - the next call makes its own slab
            logger.debug("specshim: making a slab ahead failed", exc_info=True)
            if slab is not None:
                slab.close()
            return None
        return slab
