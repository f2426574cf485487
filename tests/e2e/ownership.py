"""Who owns what ``generate()`` returned, read from ``/proc/self/maps``.

Every tensor ``generate()`` hands over must be the caller's alone, on every
path (``../shared/design/state-transport.md``): a slab the lease protocol
keeps for the caller, or memory of this process's own (the fallback's copy,
the pickled path's ``torch.load``); never vLLM's message-queue ring, a
``/dev/shm`` file the worker writes again a few messages later. Where the
memory lies is read from the process's mappings, not assumed.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch

SLAB_NAME = "specshim-states-"
RING_BUFFER = 1 << 20  # vLLM's queue sends a buffer this large out of band
QUEUE_CHUNK = 24 << 20  # a reply this large leaves the ring for zmq frames
VOCAB = 300
# Transports, by turns: the slab path (twice: it is the one users run), the
# fallback (as with no /dev/shm) and speculators' own pickled path
# (``SPECSHIM_DISABLE=state-transport``).
MODES = ("shared", "fallback", "shared", "pickled")


def mappings() -> list[tuple[int, int, str]]:
    """This process's mappings: (start, end, path; "" when anonymous)."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end, fields[5].strip() if len(fields) > 5 else ""))
    return found


def where(tensor: torch.Tensor, maps: list[tuple[int, int, str]]) -> set[str]:
    """The paths of the mappings that hold ``tensor``'s bytes (several where
    it spans adjacent mappings, as large anonymous allocations may)."""
    start = tensor.data_ptr()
    end = start + max(1, tensor.untyped_storage().nbytes())
    found = {path for low, high, path in maps if low < end and start < high}
    covered = sum(
        min(high, end) - max(low, start)
        for low, high, _ in maps
        if low < end and start < high
    )
    assert covered == end - start, f"a tensor at {start:#x} is not all mapped"
    return found


def assert_callers_own(results: list[dict[str, Any]], workers: list[int]) -> list[str]:
    """Every layer of every sequence lies in anonymous memory or the heap of
    this process, or in a slab of this generator's workers; never in a file
    anyone else writes (vLLM's ring is a /dev/shm file, psm_...)."""
    maps = mappings()
    slabs = tuple(f"{SLAB_NAME}{pid}-" for pid in workers)
    paths = []
    for index, result in enumerate(results):
        for layer, tensor in enumerate(result["hidden_states"]):
            for path in where(tensor, maps):
                mine = path in ("", "[heap]") or os.path.basename(path).startswith(
                    slabs
                )
                assert mine, f"sequence {index}, layer {layer} lies in {path}"
                paths.append(path)
    return paths


def slab_bytes(pids: list[int] | None = None) -> int:
    """Bytes of this process's slab mappings (of ``pids``' workers only)."""
    total = 0
    for low, high, path in mappings():
        name = os.path.basename(path)
        if name.startswith(SLAB_NAME) and (
            pids is None or int(name.split("-")[2]) in pids
        ):
            total += high - low
    return total


def slab_mappings(pids: list[int]) -> list[str]:
    """``pids``' slab mappings, as "name: bytes"."""
    return [
        f"{os.path.basename(path)}: {high - low}"
        for low, high, path in mappings()
        if os.path.basename(path).startswith(SLAB_NAME)
        and int(os.path.basename(path).split("-")[2]) in pids
    ]


def slab_files(pids: list[int]) -> list[str]:
    """The slab files of ``pids``' workers still in /dev/shm."""
    return [
        name
        for name in os.listdir("/dev/shm")
        if name.startswith(SLAB_NAME) and int(name.split("-")[2]) in pids
    ]


def reply_rows(generator: Any, reply_bytes: int, layers: int) -> int:
    """Rows whose states take ``reply_bytes`` over ``layers`` layers."""
    config = generator.vllm_config.model_config
    row = config.get_hidden_size() * config.dtype.itemsize
    return -(-reply_bytes // (layers * row))


def batch_of(rng: random.Random, rows: int, longest: int) -> list[list[int]]:
    """Sequences of at most ``longest`` tokens that add up to ``rows``."""
    batch = []
    while rows > 0:
        n = min(rows, longest)
        batch.append([rng.randrange(VOCAB) for _ in range(n)])
        rows -= n
    return batch


def assert_left_nothing(pids: list[int]) -> None:
    """A closed generator's workers ``pids``, with nothing of theirs held:
    none of their slabs is mapped here or left in /dev/shm."""
    import gc

    gc.collect()
    assert slab_mappings(pids) == [], "a closed generator's slabs stay mapped"
    assert slab_files(pids) == [], "a closed generator's slabs stay in /dev/shm"
