"""Runs of captured rows and the input sequences they belong to.

Shared by ``generate-guard`` (main process), which proves every returned row
from the workers' provenance record, and ``state-transport`` (worker), which
uses the same matching to lay the rows out in input order before they leave
the worker. Only the guard's proof decides: a layout the worker gets wrong is
refused there, never returned.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any

from specshim._base import SpecShimError

CAUSES = (
    "Typical causes: a sequence needs more KV-cache blocks than exist (raise "
    "gpu_memory_utilization or VLLM_CPU_KVCACHE_SPACE), a disabled specshim "
    "guard (chunked-prefill-off, prefix-caching-off), or a vLLM runner that pads "
    "or splits a step."
)


def key(ids: Any) -> bytes:
    """A sequence's tokens as bytes, equal for equal token lists or tensors."""
    import torch

    return torch.as_tensor(ids, dtype=torch.long).numpy().tobytes()


def segments(positions: Any, rows: list[int]) -> tuple[Any, Any]:
    """Split the captured rows into runs, one per request and forward.

    A run starts at position 0 or where a forward starts, and its positions
    must count 0, 1, 2, ... : a run that starts elsewhere is a partial or
    cached prefill (rows of a request whose earlier rows are not in this
    capture) or padding, and cannot be proven. Returns (starts, ends).
    """
    import torch

    total = positions.numel()
    boundary = positions == 0
    forward_starts = torch.tensor([0, *rows[:-1]], dtype=torch.long).cumsum(0)
    boundary[forward_starts[forward_starts < total]] = True
    starts = boundary.nonzero().flatten()
    ends = torch.cat([starts[1:], torch.tensor([total])])
    run = boundary.long().cumsum(0) - 1
    expected = torch.arange(total) - starts[run]
    wrong = (positions != expected).nonzero().flatten()
    if wrong.numel():
        row = int(wrong[0])
        raise SpecShimError(
            f"{wrong.numel()} captured rows cannot be proven: row {row} was computed "
            f"at position {int(positions[row])} where its run of rows needs position "
            f"{int(expected[row])} (a partial or cached prefill, or padding). " + CAUSES
        )
    return starts, ends


def match_runs(
    sequences: list[Any], token_ids: Any, positions: Any, rows: list[int]
) -> tuple[list[tuple[int, int] | None], list[tuple[int, int]]]:
    """Each sequence's run of captured rows as (start, end), None where no run
    matched it; and the runs that matched no sequence, in capture order.

    A run is matched by its whole content: identical duplicate prompts take
    runs in capture order (their rows were computed from the same tokens at
    the same positions, so they are the same), and a shared prefix is no
    ambiguity.
    """
    owners: dict[bytes, deque[int]] = defaultdict(deque)
    for index, ids in enumerate(sequences):
        owners[key(ids)].append(index)
    found: list[tuple[int, int] | None] = [None] * len(sequences)
    strays: list[tuple[int, int]] = []
    if token_ids.numel():
        starts, ends = segments(positions, rows)
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            waiting = owners.get(key(token_ids[s:e]))
            if waiting:
                found[waiting.popleft()] = (s, e)
            else:
                strays.append((s, e))
    return found, strays
