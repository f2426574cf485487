"""Captured states from a worker to the main process through shared host memory.

The worker (tensor-parallel rank 0, which always shares the main process's
host) copies a call's rows into one mapping of a file in ``/dev/shm``, pinned
for the GPU's copy engine where CUDA allows it, and replies with one small
``SharedRows`` descriptor per layer. Unpickled in the main process, a
descriptor maps the same file and becomes a CPU tensor viewing it: no tensor
is pickled, nothing lands on the main process's GPU, and the states are copied
once on their way out of the worker instead of through ``torch.save``.

Lifetime, the rule everything here relies on:

* A worker's region holds one call's states. The next ``_get_captured_states``
  overwrites it (or, when it must grow, moves to a new file; a main process
  still holding views of the old one keeps that memory alive until they go).
* The views are valid until the next fetch from the same worker. speculators
  clones every slice it returns (``h[a:b].clone().cpu()``) inside the same
  ``generate()``, before any further RPC, so what ``generate()`` returns is
  owned by its caller. Nothing else in specshim keeps a view.
* Each fetch stamps a generation number into the region's header after the
  copies are complete; a descriptor attaches only to the generation it names.
* The main process unlinks the file once it has mapped it (the worker mapped it
  first), so a killed run leaves nothing in ``/dev/shm``; a worker unlinks
  whatever the main process never attached when it exits.

Where the region cannot be had (``/dev/shm`` missing or too small: a
container's default is 64 MiB), the states travel as numpy arrays instead,
which vLLM's message queue sends out of band; a warning names the cause once.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import secrets
from typing import Any

from specshim._base import pid_alive

logger = logging.getLogger(__name__)

HEADER = 4096  # the generation number sits in the first 8 bytes
_GROW = 1.25  # grow with headroom, so slowly rising batch sizes do not remap often
_DIRECTORY = "/dev/shm"


def _dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name.rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name}")
    return dtype


class Unattached:
    """What a descriptor becomes when the main process cannot map it: any use
    raises one line that says why (raising during unpickling would break
    vLLM's reply queue instead)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def _refuse(self, *_: Any) -> Any:
        from specshim._base import SpecShimError

        raise SpecShimError(self.reason)

    __getitem__ = __len__ = __iter__ = _refuse


_ATTACHED: dict[str, mmap.mmap] = {}  # main process: path -> mapping


def attach(path: str, generation: int, offset: int, shape: Any, dtype: str) -> Any:
    """Main process: a CPU tensor viewing the rows a worker put at ``offset``."""
    import torch

    mapping = _ATTACHED.get(path)
    if mapping is None:
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
        finally:
            os.close(fd)
        _forget_older(path)
        _ATTACHED[path] = mapping
        _unlink(path)
    found = int.from_bytes(mapping[:8], "little")
    if found != generation:
        return Unattached(
            f"the captured states in {path} are of fetch {found}, not of fetch "
            f"{generation}: they were overwritten before this process read them "
            "(a specshim bug; please report it)"
        )
    count = 1
    for size in shape:
        count *= int(size)
    rows = torch.frombuffer(
        mapping, dtype=_dtype(dtype), count=count, offset=HEADER + offset
    )
    return rows.view(*shape)


def _forget_older(path: str) -> None:
    """Drop the mapping a worker used before it grew into ``path``, and those
    of workers that have exited (a process that builds generator after
    generator would otherwise keep every old region mapped)."""
    owner = path.rsplit("-", 1)[0]
    for old in list(_ATTACHED):
        if old.rsplit("-", 1)[0] == owner or not pid_alive(_owner_pid(old)):
            del _ATTACHED[old]  # views still held keep the memory alive


def _owner_pid(path: str) -> int:
    """The worker pid in ``.../specshim-states-PID-TOKEN-TOKEN``."""
    return int(os.path.basename(path).split("-")[2])


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SharedRows:
    """Pickles as the instruction to map a worker's rows (see ``attach``)."""

    def __init__(
        self, path: str, generation: int, offset: int, shape: Any, dtype: Any
    ) -> None:
        self.args = (path, generation, offset, tuple(shape), str(dtype))

    def __reduce__(self) -> tuple[Any, ...]:
        return attach, self.args


def _from_bytes(raw: Any, shape: Any, dtype: str) -> Any:
    import torch

    return torch.from_numpy(raw).view(_dtype(dtype)).view(*shape)


class OwnedRows:
    """The fallback: rows as a numpy array of bytes (sent out of band by
    vLLM's message queue), a fresh CPU tensor in the main process."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows.contiguous()

    def __reduce__(self) -> tuple[Any, ...]:
        raw = self.rows.view(-1).view(_uint8()).numpy()
        return _from_bytes, (raw, tuple(self.rows.shape), str(self.rows.dtype))


def _uint8() -> Any:
    import torch

    return torch.uint8


class HostRegion:
    """A worker's shared, growing mapping in ``/dev/shm`` (see the module
    docstring for who may read it and until when)."""

    def __init__(self, directory: str = _DIRECTORY) -> None:
        self.directory = directory
        self.prefix = f"specshim-states-{os.getpid()}-{secrets.token_hex(4)}"
        self.path: str | None = None
        self.mapping: mmap.mmap | None = None
        self.base: Any = None  # uint8 tensor over the whole mapping
        self.pinned = False
        self.pin_failed = False
        self.generation = 0
        self.failure: str | None = None  # why the fallback is in use
        atexit.register(self.close)

    def reserve(self, nbytes: int, pin: bool) -> Any | None:
        """A uint8 tensor of at least ``nbytes`` after the header, or None
        (the fallback is in use: ``failure`` says why)."""
        if self.failure is not None:
            return None
        if self.base is None or self.base.numel() < HEADER + nbytes:
            try:
                self._grow(HEADER + int(nbytes * _GROW) + 1)
            except OSError as exc:
                self.close()
                self.failure = (
                    f"{self.directory} could not hold {nbytes / 2**20:.0f} MiB of "
                    f"captured states ({exc.strerror or exc}); they travel through "
                    "vLLM's message queue instead, more slowly. A container needs "
                    "a larger /dev/shm (docker run --shm-size)"
                )
                logger.warning("specshim: %s", self.failure)
                return None
        if pin and not (self.pinned or self.pin_failed):
            self._pin()
        return self.base[HEADER:]

    def stamp(self) -> int:
        """Mark the region as holding a new fetch's rows (after the copies)."""
        assert self.mapping is not None
        self.generation += 1
        self.mapping[:8] = self.generation.to_bytes(8, "little")
        return self.generation

    def _grow(self, size: int) -> None:
        import torch

        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        self.close()
        path = os.path.join(self.directory, f"{self.prefix}-{secrets.token_hex(4)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # tmpfs allocates lazily: reserve now, or a full /dev/shm kills the
            # worker with SIGBUS in the middle of a copy.
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except OSError:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        self.path, self.mapping = path, mapping
        self.base = torch.frombuffer(mapping, dtype=torch.uint8)

    def _pin(self) -> None:
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
            self.pin_failed = True
            return
        self.pinned = True

    def close(self) -> None:
        """Unpin and drop the mapping; remove the file if nobody attached it."""
        if self.pinned and self.base is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.base.data_ptr())
        self.pinned = False
        self.base = self.mapping = None  # views elsewhere keep the memory alive
        if self.path is not None:
            _unlink(self.path)
            self.path = None
