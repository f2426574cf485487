"""Which samples share a prefix, planned before vLLM starts (issue 47's first part).

Two samples share a prefix when their first full KV-cache blocks hold the same
tokens. vLLM's prefix cache finds such blocks by a chain of hashes (each
block's hash covers the block's tokens and its parent's hash); the plan walks
the same chain over the same blocks, so that a block the plan calls shared is
one the engine can serve from its cache. ``extract`` hashes with SHA-256
(``plain_block_hasher``), not vLLM's ``hash_block_tokens``: both call the same
blocks equal (a unit test plans with each and compares), but the plan's hashes
also key the store of captured rows for the whole run, and vLLM seeds its chain
with a ``NONE_HASH`` drawn afresh (unless PYTHONHASHSEED is set) each time a
block hasher is built, which would part the plan's keys from the store's.

The plan:

* **orders** the samples so that those sharing a prefix run next to each
  other (the lexicographic order of their chains of shared blocks: a trie's
  depth-first order), so the cache still holds a prefix when its next sample
  comes;
* says for each sample how many of its tokens the cache may serve
  (``reuse``): its leading full blocks that a sample before it in that order
  holds too, but never its last token (vLLM always computes a prompt's last
  token, so a hit stops at the last whole block before it);
* bounds the host memory the prefixes' captured rows take while they wait for
  their next sample: every shared block's rows are held from the first sample
  that computes them to the last that reuses them, and ``peak_bytes`` is the
  most held at once. Samples sharing a first block form a group, run
  together, so groups never hold rows at the same time; under a cap, a group
  whose rows would exceed it is computed whole, each of its samples named in
  ``cut`` (vLLM's cache is all or nothing for a request: one whose prefix
  must not hit is given a cache salt of its own).

What the cache really served is read, at run time, from the rows the forward
recorded; the plan is what the run expects, never what it assumes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specshim._prefix_reuse import BlockHasher, chain, plain_block_hasher

__all__ = [
    "PrefixPlan",
    "chain",
    "engine_block_hasher",
    "engine_hash_fn",
    "may_share",
    "plain_block_hasher",
    "plan_prefixes",
]

# The smallest KV-cache block the generator's engine counts in: speculators
# builds its CacheConfig with block_size=16, which vLLM keeps or raises (64 or
# 128 for some MLA kernels; on the CPU from vLLM 0.29, where the patch
# ``cpu_block_size`` lets the platform choose, 128, or 16 for its MLA), and
# the scheduler multiplies by the context-parallel sizes.
SMALLEST_BLOCK = 16


@dataclass(frozen=True)
class PrefixPlan:
    """What ``plan_prefixes`` decided (see the module docstring)."""

    order: tuple[int, ...]  # sample indexes, in the order to feed them
    reuse: dict[int, int]  # index -> tokens an earlier sample computes for it
    keep_until: dict[Hashable, int] = field(repr=False)  # block -> last index
    peak_bytes: int  # the most bytes of prefix rows held at once
    cut: tuple[int, ...]  # samples computed whole: their group's rows over the cap
    uses: dict[Hashable, int] = field(repr=False)  # block -> samples sharing it

    @property
    def reused_tokens(self) -> int:
        return sum(self.reuse.values())


def may_share(
    samples: Iterable[Sequence[int]], smallest_block: int = SMALLEST_BLOCK
) -> bool:
    """Whether any two samples could share a prefix at any block size of at
    least ``smallest_block``: False only where no two hold the same first
    ``smallest_block`` tokens, so that no full first block, of that size or
    larger, is shared and the cache could serve nothing. Where it says False
    the prefix cache need not be on at all (vLLM hashes every block of every
    request when it is)."""
    seen: set[tuple[int, ...]] = set()
    for ids in samples:
        if len(ids) < smallest_block:
            continue  # holds no full block
        first = tuple(ids[:smallest_block])
        if first in seen:
            return True
        seen.add(first)
    return False


def engine_hash_fn(algorithm: str = "sha256") -> Callable[[Any], bytes]:
    """The hash function vLLM's ``prefix_caching_hash_algo`` names (its
    ``NONE_HASH`` seeded with it where vLLM has not yet), or ``SpecShimError``
    where this vLLM has another shape."""
    from vllm.v1.core import kv_cache_utils

    from specshim._base import SpecShimError

    by_name = None
    for where in ("vllm.utils.hashing", "vllm.utils"):
        try:
            module = __import__(where, fromlist=["get_hash_fn_by_name"])
        except ImportError:
            continue
        by_name = getattr(module, "get_hash_fn_by_name", None)
        if by_name is not None:
            break
    if by_name is None or not hasattr(kv_cache_utils, "init_none_hash"):
        raise SpecShimError(
            "prefix reuse: this vLLM has no get_hash_fn_by_name where specshim "
            "looks; run without it"
        )
    hash_fn = by_name(algorithm)
    if getattr(kv_cache_utils, "NONE_HASH", None) is None:
        kv_cache_utils.init_none_hash(hash_fn)
    return hash_fn


def engine_block_hasher(algorithm: str = "sha256") -> BlockHasher:
    """vLLM's own block hashing (``hash_block_tokens`` with the hash function
    ``prefix_caching_hash_algo`` names), or ``SpecShimError`` where this vLLM
    has another shape."""
    from vllm.v1.core import kv_cache_utils

    from specshim._base import SpecShimError

    hash_fn = engine_hash_fn(algorithm)
    hash_tokens = getattr(kv_cache_utils, "hash_block_tokens", None)
    if hash_tokens is None:
        raise SpecShimError(
            "prefix reuse: this vLLM has no hash_block_tokens where specshim "
            "looks; run without it"
        )
    return lambda parent, tokens: hash_tokens(hash_fn, parent, tokens)


def plan_prefixes(
    samples: Iterable[tuple[int, Sequence[int]]],
    block_size: int,
    bytes_per_token: int,
    cap_bytes: int | None = None,
    hasher: BlockHasher | None = None,
) -> PrefixPlan:
    """Plan the reuse of shared prefixes for ``samples`` (index, token ids)."""
    hasher = hasher or plain_block_hasher()
    chains: dict[int, list[Hashable]] = {}
    usable: dict[int, int] = {}  # blocks the cache may serve: not the last token's
    lengths: dict[int, int] = {}
    counts: dict[Hashable, int] = {}
    for index, ids in samples:
        hashes = chain(ids, block_size, hasher)  # a whole last block serves others
        chains[index] = hashes
        usable[index] = (len(ids) - 1) // block_size if ids else 0
        lengths[index] = len(ids)
        for block in hashes:
            counts[block] = counts.get(block, 0) + 1
    shared = {index: _leading(hashes, counts) for index, hashes in chains.items()}
    # Within a chain, shorter first: a sample that is another's prefix then
    # computes its last block for the longer one, instead of the reverse.
    # Samples that share nothing keep the dataset's order.
    order = tuple(
        sorted(
            chains,
            key=lambda i: (_sort_key(shared[i]), lengths[i] if shared[i] else 0, i),
        )
    )
    groups: dict[Hashable, list[int]] = {}  # first shared block -> its samples
    for index in order:
        if shared[index]:
            groups.setdefault(shared[index][0], []).append(index)
    block_bytes = block_size * bytes_per_token
    peaks = {
        first: _peak(members, shared, block_bytes) for first, members in groups.items()
    }
    cut = sorted(
        index
        for first, members in groups.items()
        if cap_bytes is not None and peaks[first] > cap_bytes
        for index in members
    )
    kept = set(order) - set(cut)
    reuse, keep_until, uses, seen = {}, {}, {}, set()
    for index in order:  # the blocks an earlier sample computed are served
        blocks = shared[index] if index in kept else []
        for block in blocks:
            uses[block] = uses.get(block, 0) + 1
        servable = blocks[: usable[index]]
        served = next(
            (n for n, b in enumerate(servable) if b not in seen), len(servable)
        )
        reuse[index] = served * block_size
        keep_until.update((block, index) for block in blocks)
        seen.update(blocks)
    peak = max((p for f, p in peaks.items() if groups[f][0] in kept), default=0)
    return PrefixPlan(order, reuse, keep_until, peak, tuple(cut), uses)


def _leading(hashes: list[Hashable], counts: dict[Hashable, int]) -> list[Hashable]:
    """The leading blocks of a chain that another sample holds too."""
    shared = []
    for block in hashes:
        if counts[block] < 2:
            break
        shared.append(block)
    return shared


def _sort_key(blocks: list[Hashable]) -> tuple[str, ...]:
    # hashes of different types do not compare; their text does, and equal
    # chains still sort together
    return tuple(repr(block) for block in blocks)


def _peak(
    members: list[int], shared: dict[int, list[Hashable]], block_bytes: int
) -> int:
    """The most bytes of shared blocks' rows held at once while ``members``
    run in this order: a block is held from the first sample that has it to
    the last (``shared`` holds only blocks two samples or more have)."""
    first: dict[Hashable, int] = {}
    last: dict[Hashable, int] = {}
    for position, index in enumerate(members):
        for block in shared[index]:
            first.setdefault(block, position)
            last[block] = position
    events: dict[int, int] = {}
    for block, start in first.items():
        events[start] = events.get(start, 0) + 1
        events[last[block] + 1] = events.get(last[block] + 1, 0) - 1
    held = peak = 0
    for position in sorted(events):
        held += events[position]
        peak = max(peak, held)
    return peak * block_bytes
