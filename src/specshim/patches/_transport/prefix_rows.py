"""Rows vLLM's prefix cache served, put back in front of the rows it computed
(``specshim._prefix_reuse`` says why that is sound and keeps the earlier
calls' rows).

``stitch`` completes each sequence of a call: its tail from the capture, each
served block from a sequence of the same call that computed it, else from the
store. A sequence with a block found nowhere is left for the caller to compute
whole (with a cache salt of its own, so nothing is served). Nothing is
guessed: a block's rows are used only under the hash of every token before its
end.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from specshim._prefix_reuse import PrefixRows, chain


def stitch(
    sequences: list[Sequence[int]],
    stacked: list[Any],
    found: list[tuple[int, int, int] | None],
    block_size: int,
    store: PrefixRows,
) -> list[list[Any] | None]:
    """Each sequence's rows, one tensor per layer, or None where a served block
    is found nowhere (or no run was proven for it): computed whole by the caller.

    ``stacked``: the call's capture, one tensor per layer; ``found``:
    ``match_tails``' runs, ``(start, end, k)``. A sequence of whole blocks
    with no run of its own (its rows read as the start of a longer sequence's
    run, which continued it in the same forward) is complete from its blocks
    alone.
    """
    store.bind(stacked)
    call = _Call(sequences, block_size, store)
    # A served block was computed by a sequence served less: fewest first.
    ran = [i for i, run in enumerate(found) if run is not None]
    for i in sorted(ran, key=lambda i: found[i][2]):  # type: ignore[index]
        start, end, k = found[i]  # type: ignore[misc]
        heads = call.blocks(i, k // block_size)
        if heads is not None:
            call.done(i, heads, [h[start:end] for h in stacked], k, end - start)
    for i, ids in enumerate(sequences):
        if call.out[i] is None and found[i] is None and len(ids) % block_size == 0:
            heads = call.blocks(i, len(ids) // block_size)
            if heads is not None:
                call.done(i, heads, [], len(ids), 0)
    return call.out


class _Call:
    """One call's sequences as they are completed, and where each block's rows
    are: in a sequence of the call, else in the store."""

    def __init__(
        self, sequences: list[Sequence[int]], block_size: int, store: PrefixRows
    ) -> None:
        self.block, self.store = block_size, store
        self.chains = [chain(ids, block_size) for ids in sequences]
        self.out: list[list[Any] | None] = [None] * len(sequences)
        self.here: dict[Hashable, tuple[int, int]] = {}  # block -> (sequence, j)

    def blocks(self, i: int, count: int) -> list[list[Any]] | None:
        """The rows of sequence i's first ``count`` blocks, or None."""
        rows: list[list[Any]] = []
        for block in self.chains[i][:count]:
            if block in self.here:
                owner, at = self.here[block]
                states = self.out[owner]
                assert states is not None
                span = slice(at * self.block, (at + 1) * self.block)
                rows.append([h[span] for h in states])
            elif (kept := self.store.get(block)) is not None:
                rows.append(kept)
            else:
                return None
        return rows

    def done(
        self, i: int, heads: list[list[Any]], tail: list[Any], served: int, ran: int
    ) -> None:
        """Sequence i is its served blocks' rows, then ``tail``."""
        import torch

        if heads:
            width = len(heads[0])
            tail = [
                torch.cat([*(head[n] for head in heads), *tail[n : n + 1]])
                for n in range(width)
            ]
        else:  # its own storage: a view would carry the whole call's rows along
            tail = [t.clone() for t in tail]
        self.out[i] = tail
        self.store.served_tokens += served
        self.store.computed_tokens += ran
        for j, block in enumerate(self.chains[i]):
            self.here.setdefault(block, (i, j))
