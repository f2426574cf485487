"""Runs of captured rows and the input sequences they belong to.

Shared by ``generate-guard`` (main process), which proves every returned row
from the workers' provenance record, and ``state-transport`` (worker), which
uses the same matching to lay the rows out in input order before they leave
the worker. Only the guard's proof decides: a layout the worker gets wrong is
refused there, never returned; rows proven but out of input order are
re-sliced there (``reorder``).
"""

from __future__ import annotations

import itertools
import logging
from collections import defaultdict, deque
from typing import Any

from specshim._base import SpecShimError

logger = logging.getLogger(__name__)

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
    starts, ends, _ = runs(positions, rows, block=0)
    return starts, ends


def runs(positions: Any, rows: list[int], block: int) -> tuple[Any, Any, Any]:
    """``segments``, and where prefix caching may have served a request's
    first rows (``block``: the KV cache's block size; 0: it may not), runs
    that start later: a run also starts where the positions stop counting up,
    and its first position must be a whole number of blocks (vLLM serves
    whole blocks from its cache). Returns (starts, ends, first positions).
    """
    import torch

    total = positions.numel()
    boundary = positions == 0
    forward_starts = torch.tensor([0, *rows[:-1]], dtype=torch.long).cumsum(0)
    boundary[forward_starts[forward_starts < total]] = True
    if block and total:
        boundary[1:] |= positions[1:] != positions[:-1] + 1
    starts = boundary.nonzero().flatten()
    ends = torch.cat([starts[1:], torch.tensor([total])])
    firsts = positions[starts].long() if block else torch.zeros_like(starts)
    if block and bool((firsts % block != 0).any()):
        at = int(starts[(firsts % block != 0).nonzero().flatten()[0]])
        raise SpecShimError(
            f"captured rows cannot be proven: a run of rows starts at position "
            f"{int(positions[at])} (row {at}), which is no whole number of "
            f"{block}-token cache blocks (padding, or a partial prefill). " + CAUSES
        )
    run = boundary.long().cumsum(0) - 1
    expected = firsts[run] + torch.arange(total) - starts[run]
    wrong = (positions != expected).nonzero().flatten()
    if wrong.numel():
        row = int(wrong[0])
        raise SpecShimError(
            f"{wrong.numel()} captured rows cannot be proven: row {row} was computed "
            f"at position {int(positions[row])} where its run of rows needs position "
            f"{int(expected[row])} (a partial or cached prefill, or padding). " + CAUSES
        )
    return starts, ends, firsts


def in_input_order(
    sequences: list[Any], token_ids: Any, positions: Any, rows: list[int]
) -> bool:
    """Whether the captured rows are the sequences themselves, whole, one
    after another in input order, with no sequence split between forwards:
    then sequence i's run is its own offset onward, exactly what
    ``match_runs`` would find (checked in a quarter of its time: a call's
    rows are in this order whenever the runner computed them in the order
    ``generate-guard`` sends them)."""
    import itertools

    import numpy as np

    lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    total = int(lengths.sum())
    if not total or sum(rows) != total or token_ids.numel() != total:
        return False
    if positions.numel() != total:
        return False
    flat = itertools.chain.from_iterable(sequences)
    if not np.array_equal(token_ids.numpy(), np.fromiter(flat, np.int64, total)):
        return False
    ends = np.cumsum(lengths)
    counting = np.arange(total) - np.repeat(ends - lengths, lengths)
    if not np.array_equal(positions.numpy(), counting):
        return False
    return bool(np.isin(np.cumsum(rows), ends).all())


def whole_in_input_order(
    sequences: list[Any], token_ids: Any, positions: Any, rows: list[int]
) -> list[tuple[int, int, int]] | None:
    """``match_tails``' runs where every sequence was computed whole, one
    after another in input order (``in_input_order``), in a sixth of its
    time; None otherwise. Sound with the prefix cache on: the rows are as
    many as the sequences' tokens, so no request was served any (the cache
    serves a request's leading blocks, which it then does not compute), and
    each run is one request from position 0 with the sequence's tokens."""
    if not in_input_order(sequences, token_ids, positions, rows):
        return None
    ends = itertools.accumulate(map(len, sequences))
    return [(end - len(seq), end, 0) for end, seq in zip(ends, sequences, strict=True)]


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


def match_tails(
    sequences: list[Any], token_ids: Any, positions: Any, rows: list[int], block: int
) -> tuple[list[tuple[int, int, int] | None], list[tuple[int, int]], list[int]]:
    """``match_runs`` where vLLM's prefix cache may have served each
    sequence's first ``k`` rows (``k`` a whole number of ``block``-token
    blocks, 0 where nothing was served): each sequence's run as ``(start,
    end, k)``, None where none matched; the runs that matched none; and the
    sequences whose run cannot be told apart from another's.

    A run whose first position is ``k`` matches a sequence whose tokens from
    ``k`` on are the run's tokens. Its rows were computed after that
    sequence's first ``k`` tokens only if no other sequence of the call with
    the same tail differs in those ``k`` tokens: the rows carry the tail's
    tokens and positions, not the prefix they attended to. Where two such
    sequences exist, every sequence with that tail is left unmatched and named
    in the third list, for the caller to compute whole; their runs are in
    neither of the other lists. Exact duplicates take runs in capture order,
    as in ``match_runs``. A served run whose first position happens to follow
    on from the run before it in the same forward reads as part of that run
    (the rows carry no request boundary). Where the joined run matches no
    sequence it is a stray; where it does, it is taken only if no sequence of
    the call could have lent it a tail (``_Lenders``): else that
    sequence is named in the third list too.
    """
    found: list[tuple[int, int, int] | None] = [None] * len(sequences)
    strays: list[tuple[int, int]] = []
    if not token_ids.numel():
        return found, strays, []
    starts, ends, firsts = runs(positions, rows, block)
    owners: dict[tuple[int, bytes], list[int]] = {}
    untold: dict[tuple[int, bytes], list[int]] = {}  # tails after other heads
    for k in sorted(set(firsts.tolist())):
        heads: dict[bytes, set[bytes]] = defaultdict(set)
        by_tail: dict[bytes, list[int]] = defaultdict(list)
        for index, ids in enumerate(sequences):
            ids = list(ids)
            if len(ids) > k:
                tail = key(ids[k:])
                by_tail[tail].append(index)
                heads[tail].add(key(ids[:k]))
        for tail, claimants in by_tail.items():
            kept = untold if len(heads[tail]) > 1 else owners
            kept[(k, tail)] = claimants
    for s, e, k in zip(starts.tolist(), ends.tolist(), firsts.tolist(), strict=True):
        tail = key(token_ids[s:e])
        free = [i for i in owners.get((k, tail), ()) if found[i] is None]
        if free:  # a sequence can own tails at several k: take it once
            found[free[0]] = (s, e, k)
        elif (k, tail) not in untold:
            strays.append((s, e))
    named = {i for claimants in untold.values() for i in claimants}
    lent = _Lenders(sequences)
    for index, hit in enumerate(found):
        if hit is not None and lent.may_hold_a_lent_tail(index, hit[2], block):
            found[index] = None
            named.add(index)
    return found, strays, sorted(i for i in named if found[i] is None)


class _Lenders:
    """The call's sequences as tensors, each with its length and last token,
    made once a call (not once a matched sequence)."""

    def __init__(self, sequences: list[Any]) -> None:
        import torch

        self.seqs = [
            torch.as_tensor(x, dtype=torch.long).reshape(-1) for x in sequences
        ]
        self.lists = [x.tolist() for x in self.seqs]
        # (length, last token) of each sequence: a request that ends at p
        self.ends = {(len(x), x[-1] if x else None) for x in self.lists}

    def may_hold_a_lent_tail(self, index: int, k: int, block: int) -> bool:
        """Whether the run matched to sequence ``index`` at ``k`` may end in
        another request's served tail: rows of a sequence ``j`` of the call
        computed from a whole block ``p >= k`` on, joined to the rows of a
        request that ends at ``p`` because their positions follow on. Such
        rows were computed after ``j``'s first ``p`` tokens, so they are this
        sequence's only where ``j[:p]`` is its ``[:p]``. The run is refused if
        some ``j`` has, at a whole block ``p`` with ``k <= p < len(j) <=
        len(sequence)``, the same tokens from ``p`` to its end and other
        tokens before ``p``, where ``p`` is the run's start or another
        sequence of the call ``p`` tokens long ends with this one's token
        ``p-1``."""
        ids, listed = self.seqs[index], self.lists[index]
        n = len(listed)
        for j, other in enumerate(self.seqs):
            m = len(self.lists[j])
            if j == index or not k < m <= n or self.lists[j][-1] != listed[m - 1]:
                continue  # no tail after k, or none that ends as this one does
            differ = (other != ids[:m]).nonzero().flatten()
            if not differ.numel():
                continue  # j is this sequence's first m tokens: the same rows
            same_tail = m - 1 - int(differ[-1])  # tokens equal at the end
            first = max(k, m - same_tail, int(differ[0]) + 1)
            for p in range(-(-first // block) * block, m, block):
                if p == k or (p, listed[p - 1]) in self.ends:
                    return True  # j's tail starts the run, or follows a request
        return False


def checked_record(record: dict[str, Any]) -> tuple[Any, Any, list[int]]:
    """The record's token ids, positions and rows per forward, once they add up."""
    problems = record.get("problems") or []
    if problems:
        raise SpecShimError(
            f"{len(problems)} captured forward(s) have no provable rows: "
            f"{problems[0]}. " + CAUSES
        )
    token_ids, positions = record["token_ids"], record["positions"]
    rows = [int(n) for n in record["rows"]]
    if not (token_ids.numel() == positions.numel() == sum(rows)):
        raise SpecShimError(
            f"the workers recorded {token_ids.numel()} token ids and "
            f"{positions.numel()} positions for {sum(rows)} captured rows"
        )
    return token_ids, positions, rows


def misalignment(missing: list[int], strays: int, total: int) -> SpecShimError:
    """The error for sequences without rows and rows without a sequence."""
    detail = []
    if missing:
        shown = ", ".join(str(i) for i in missing[:8])
        more = " ..." if len(missing) > 8 else ""
        detail.append(
            f"no rows computed for sequence(s) {shown}{more} "
            f"({len(missing)} of {total})"
        )
    if strays:
        detail.append(
            f"{strays} run(s) of captured rows belong to no input sequence "
            "(duplicated, padded or foreign rows)"
        )
    return SpecShimError(
        "hidden states do not line up with the input sequences: "
        + "; ".join(detail)
        + ". Returning them would misalign training data. "
        + CAUSES
    )


def reorder(
    results: list[dict[str, Any]], sequences: list[Any], begin: list[int]
) -> list[dict[str, Any]]:
    """Give each result the rows ``prove_rows`` found for it.

    speculators sliced the capture positionally; with every row proven and
    owned once, the concatenation of its slices is the whole capture.
    """
    import torch

    for index, (result, ids) in enumerate(zip(results, sequences, strict=True)):
        if not torch.equal(result["input_ids"], torch.as_tensor(ids, dtype=torch.long)):
            raise SpecShimError(
                f"speculators returned other input_ids for sequence {index} than it "
                "was given"
            )
        for layer, states in enumerate(result["hidden_states"]):
            if states.shape[0] != len(ids):
                raise SpecShimError(
                    f"sequence {index} has {len(ids)} tokens but {states.shape[0]} "
                    f"rows for its layer #{layer}"
                )
    offsets = [0]
    for ids in sequences[:-1]:
        offsets.append(offsets[-1] + len(ids))
    if begin == offsets:
        return results
    # Normal under the V2 runner when the workers cannot order rows
    # themselves (state-transport turned off): not worth a warning per call.
    logger.debug("specshim: captured rows were out of input order; re-sliced them")
    num_layers = len(results[0]["hidden_states"])
    stacked = [
        torch.cat([r["hidden_states"][k] for r in results]) for k in range(num_layers)
    ]
    for result, start, ids in zip(results, begin, sequences, strict=True):
        n = len(ids)
        result["hidden_states"] = [h[start : start + n].clone() for h in stacked]
    return results
