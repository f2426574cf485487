"""Shared prefixes computed once: what ``extract --reuse-prefixes`` and the
shim share (the job reaches it here, never in ``patches/``).

With prefix caching on (``SPECSHIM_REUSE_PREFIXES=1``, which
``extract --reuse-prefixes`` sets while the generator starts), a request whose
first ``k`` tokens (whole KV blocks) are cached is computed from token ``k``
on. ``generate-guard`` proves which tail is whose (``rows.match_tails``) and
puts the first ``k`` rows back from where those tokens were computed
(``patches/_transport/prefix_rows.stitch``). A hidden state at position ``p``
depends only on tokens ``0..p``, so the rows of a block computed after exactly
the same tokens are that block's rows for every sequence that starts with
them; blocks are known by the chain hash of every token up to their end.

``PrefixRows`` holds the rows of earlier calls under a byte cap. Given a
plan's ``uses`` (how many samples still share each block), it keeps a block
only while a sample still needs it and drops it after its last; without one
(the library path), it keeps the most recent blocks that fit, dropping chains
from their ends (``offer``).
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from specshim._base import UsageError

BlockHasher = Callable[[Any, Sequence[int]], Hashable]

REUSE = "SPECSHIM_REUSE_PREFIXES"
# The library path's cap where none is given: SPECSHIM_PREFIX_ROWS_MIB.
CAP_VARIABLE = "SPECSHIM_PREFIX_ROWS_MIB"
DEFAULT_CAP_MIB = 1024


def reusing_prefixes() -> bool:
    """Whether the generator about to start is to keep prefix caching on."""
    return os.environ.get(REUSE, "").strip().lower() in ("1", "true", "yes", "on")


def scheduler_block_size(vllm_config: Any) -> int:
    """The block size vLLM's scheduler counts in: the cache's, times the
    context-parallel sizes where this vLLM has them."""
    parallel = vllm_config.parallel_config
    return int(
        vllm_config.cache_config.block_size
        * getattr(parallel, "decode_context_parallel_size", 1)
        * getattr(parallel, "prefill_context_parallel_size", 1)
    )


def reuse_block(vllm_config: Any) -> int:
    """The KV block size where the generator's prefix cache is on, else 0."""
    if not getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        return 0
    return scheduler_block_size(vllm_config)


def default_store() -> PrefixRows:
    """The library path's store: the most recent blocks under
    ``SPECSHIM_PREFIX_ROWS_MIB`` (default ``DEFAULT_CAP_MIB``)."""
    mib = os.environ.get(CAP_VARIABLE, "").strip()
    if not mib:
        return PrefixRows(DEFAULT_CAP_MIB << 20)
    if not mib.isdigit():  # a typo must not quietly become a gigabyte
        raise UsageError(
            f"{CAP_VARIABLE}={mib!r} is not a whole number of MiB: give one "
            f"(0 keeps no rows between calls) or unset it for {DEFAULT_CAP_MIB}"
        )
    return PrefixRows(int(mib) << 20)


def prefix_store(generator: Any) -> PrefixRows:
    """The generator's ``PrefixRows`` (``extract`` gives it its plan's with
    ``give_store``; else ``default_store()``, made on first use)."""
    store = getattr(generator, _STORE, None)
    if store is None:
        store = default_store()
        setattr(generator, _STORE, store)
    return store


def give_store(generator: Any, store: PrefixRows) -> None:
    """Make ``store`` the generator's ``PrefixRows``."""
    setattr(generator, _STORE, store)


_STORE = "_specshim_prefix_rows"


def plain_block_hasher() -> BlockHasher:
    """SHA-256 of (parent hash, block tokens as int64)."""

    def hasher(parent: Any, tokens: Sequence[int]) -> bytes:
        data = (parent or b"") + array("q", tokens).tobytes()
        return hashlib.sha256(data).digest()

    return hasher


_HASH = plain_block_hasher()


def chain(
    ids: Sequence[int], block_size: int, hasher: BlockHasher = _HASH
) -> list[Hashable]:
    """The hashes of ``ids``'s full blocks, each covering its parent's."""
    hashes: list[Hashable] = []
    parent = None
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hasher(parent, ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def digest(ids: Sequence[int]) -> bytes:
    """A sequence's identity for ``PrefixRows.whole``."""
    return hashlib.sha256(array("q", ids).tobytes()).digest()


class PrefixRows:
    """Captured rows of whole blocks, by chain hash, under ``cap_bytes``.

    ``uses``: block -> samples left that share it (from the plan); None keeps
    the most recent blocks that fit. ``whole``: digests of sequences to be
    computed whole, never served (the plan's cut). ``pieces``: a sequence
    served rows is handed as a ``Joined`` per layer (its pieces, not copied
    into one tensor; ``specshim/_joined.py``), for a caller that writes
    them as they are (``extract``'s writer); otherwise as tensors, as
    speculators' ``generate()`` returns. Counters say what it did.
    """

    def __init__(
        self,
        cap_bytes: int,
        uses: dict[Hashable, int] | None = None,
        whole: set[bytes] | None = None,
        pieces: bool = False,
    ) -> None:
        self.cap_bytes = cap_bytes
        self.pieces = pieces
        self.uses = uses
        self.whole = whole or set()
        self.blocks: OrderedDict[Hashable, list[Any]] = OrderedDict()
        self.group: dict[Hashable, _Group] = {}  # block -> the copy it is in
        self.held_bytes = self.peak_bytes = 0
        self.served_tokens = 0  # rows filled from cached blocks
        self.computed_tokens = 0  # rows the capture held
        self.recomputed = 0  # sequences computed whole after a miss
        self.refused_bytes = 0  # rows not kept: over the cap
        # The main process's own work on served rows, where a GPU run's time
        # goes (``patches/_transport/prefix_rows``): seconds putting them back
        # (``stitch``) and keeping blocks (``keep``), bytes copied for both,
        # and the page faults this process took meanwhile (fresh memory is
        # mapped in page by page).
        self.stitch_seconds = self.keep_seconds = 0.0
        self.copied_bytes = self.faults = 0
        self.rows_of: tuple[Any, ...] | None = None  # (layers' width, dtype)

    def bind(self, layers: list[Any]) -> None:
        """Check that a call's captured rows are the kind this store holds
        (the same layers, widths and dtypes): rows are known by their tokens
        alone, so one store must never serve two models or layer sets."""
        kind = tuple((tuple(t.shape[1:]), str(t.dtype)) for t in layers)
        if self.rows_of is None:
            self.rows_of = kind
        elif kind != self.rows_of:
            raise UsageError(
                f"prefix reuse: this store holds rows of {len(self.rows_of)} "
                f"layers {self.rows_of}, the call captured {len(kind)} {kind}: "
                "give each generator a store of its own"
            )

    def get(self, block: Hashable) -> list[Any] | None:
        return self.blocks.get(block)  # ``offer`` marks what a call used

    def done(
        self, ids: Sequence[int], block_size: int, hashes: list[Hashable] | None = None
    ) -> None:
        """A sample is complete: one use fewer of each block it shares
        (``hashes``: ``chain(ids, block_size)``, where the caller has it)."""
        if self.uses is None:
            return
        for block in chain(ids, block_size) if hashes is None else hashes:
            left = self.uses.get(block)
            if left is None:
                break  # the shared blocks lead a chain
            if left <= 1:
                self.uses.pop(block)
                self._drop(block)
            else:
                self.uses[block] = left - 1

    def offer(
        self,
        ids: Sequence[int],
        layers: list[Any],
        block_size: int,
        hashes: list[Hashable] | None = None,
    ) -> None:
        """Keep the blocks of a complete sequence that are still wanted.

        With a plan, consecutive blocks that the same samples still share (as
        many uses left: a later block's sharers are among an earlier one's)
        are dropped together, so they are kept as one copy: a sequence served
        them later joins one piece, not one a block.

        Without a plan (the most recent that fit), a block is kept only with
        the blocks before it in its chain, and a chain's blocks are marked
        used from its last to its first: the oldest block is then always one
        no held block follows, so the cap drops chains from their ends and
        never holds rows that could not be served (a block is served only
        after every block before it)."""
        if hashes is None:
            hashes = chain(ids, block_size)
        if self.uses is not None:
            self._offer_planned(hashes, layers, block_size, self.uses)
            return
        self._used(hashes)
        held = 0  # the chain's held blocks lead it (every one's parent is held)
        while held < len(hashes) and hashes[held] in self.blocks:
            self.group[hashes[held]].served = True
            held += 1
        if held < len(hashes):
            size = self._block_bytes(layers, block_size) * (len(hashes) - held)
            self._room(size, keep=set(hashes))
            self._keep(hashes[held:], layers, held, block_size)
        self._used(hashes)

    def _offer_planned(
        self,
        hashes: list[Hashable],
        layers: list[Any],
        block_size: int,
        uses: dict[Hashable, int],
    ) -> None:
        j = 0
        while j < len(hashes) and hashes[j] in uses:
            if hashes[j] in self.blocks:
                j += 1
                continue
            end, left = j + 1, uses[hashes[j]]
            while (
                end < len(hashes)
                and uses.get(hashes[end]) == left
                and hashes[end] not in self.blocks
            ):
                end += 1
            self._keep(hashes[j:end], layers, j, block_size)
            j = end

    @staticmethod
    def _block_bytes(layers: list[Any], block_size: int) -> int:
        return sum(block_size * h[:1].numel() * h.element_size() for h in layers)

    def _keep(
        self, blocks: list[Hashable], layers: list[Any], first: int, block_size: int
    ) -> bool:
        """Keep ``blocks`` (the chain's blocks from number ``first`` on) as one
        copy, as many of them as the cap allows; whether all were kept."""
        each = self._block_bytes(layers, block_size)
        room = max(self.cap_bytes - self.held_bytes, 0) // each if each else len(blocks)
        count = min(len(blocks), room)
        self.refused_bytes += (len(blocks) - count) * each
        if count:
            span = slice(first * block_size, (first + count) * block_size)
            group = _Group(
                [h[span].clone() for h in layers], blocks[:count], count * each
            )
            self.copied_bytes += group.nbytes
            for n, block in enumerate(blocks[:count]):
                rows = slice(n * block_size, (n + 1) * block_size)
                self.blocks[block] = [h[rows] for h in group.rows]
                self.group[block] = group
            self.held_bytes += group.nbytes
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return count == len(blocks)

    def _used(self, hashes: list[Hashable]) -> None:
        """Mark a chain's held blocks the most recent, its first block last."""
        for block in reversed(hashes):
            if block in self.blocks:
                self.blocks.move_to_end(block)

    def _room(self, size: int, keep: set[Hashable]) -> None:
        """Drop the least recent blocks, none of ``keep``, until ``size`` fits.

        A copy's memory goes with its last block; where blocks of a copy are
        dropped and others are still held (a chain's head that other chains
        share), those are copied anew, alone, once the dropping is done
        (``_shrink``): what is held never counts memory of dropped rows."""
        dropped: dict[_Group, int] = {}  # copies still held: blocks dropped
        while self.blocks:
            freed = sum(g.nbytes // g.count * n for g, n in dropped.items())
            if self.held_bytes - freed + size <= self.cap_bytes:
                break
            oldest = next(iter(self.blocks))
            if oldest in keep:
                break  # the chain being offered is all that is held
            group = self.group[oldest]
            if not group.served:  # kept together, never used since: go together
                for block in group.blocks:
                    if self.group.get(block) is group:
                        self._drop(block)
                continue
            self._drop(oldest)
            if group.held:
                dropped[group] = dropped.get(group, 0) + 1
            else:
                dropped.pop(group, None)
        for group in dropped:
            self._shrink(group)

    def _shrink(self, group: _Group) -> None:
        """Copy ``group``'s held blocks into a copy of their own, in the order
        they had, and let the old one go."""
        import torch

        blocks = [b for b in group.blocks if self.group.get(b) is group]
        rows = group.rows[0].shape[0] // group.count  # a block's
        nbytes = group.nbytes // group.count * len(blocks)
        alone = _Group(
            [
                torch.cat([self.blocks[b][k] for b in blocks])
                for k in range(len(group.rows))
            ],
            blocks,
            nbytes,
        )
        alone.served = group.served
        self.copied_bytes += nbytes
        for n, block in enumerate(blocks):
            self.blocks[block] = [h[n * rows : (n + 1) * rows] for h in alone.rows]
            self.group[block] = alone
        self.held_bytes += nbytes - group.nbytes

    def _drop(self, block: Hashable) -> None:
        """Let go of ``block``; its copy's bytes once no block of it is held."""
        if self.blocks.pop(block, None) is None:
            return
        group = self.group.pop(block)
        group.held -= 1
        if not group.held:
            self.held_bytes -= group.nbytes


class _Group:
    """Consecutive blocks kept as one copy (per layer), in the copy's order,
    how many of them are still held (its memory goes with the last), and
    whether a later sequence was served any of them."""

    __slots__ = ("blocks", "count", "held", "nbytes", "rows", "served")

    def __init__(self, rows: list[Any], blocks: list[Hashable], nbytes: int) -> None:
        self.rows, self.blocks, self.nbytes = rows, blocks, nbytes
        self.held = self.count = len(blocks)  # blocks in the copy
        self.served = False
