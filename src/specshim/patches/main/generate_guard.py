"""Input checks and a row-alignment check around ``generate()``.

Why:
    speculators slices the captured rows into sequences by position: sequence
    i gets the next ``len(ids_i)`` rows. Anything that makes the workers compute
    other rows than expected (a request that never fits the KV cache, a partial
    prefill, a cache hit, a batch order that differs from input order) shifts
    every later sequence and still returns a full-looking list. This guard:

    * before the call, rejects what vLLM would turn into garbage or a crash in
      a worker: an empty batch or sequence, token ids outside
      ``[0, vocab_size)``; it warns (with a count) about sequences that
      speculators will silently truncate to ``max_model_len - 1`` tokens;
    * after the call, proves every returned row from what the workers
      recorded it was computed from (worker patch ``row-provenance``: the token
      id and position of every captured row, taken from the forward pass, not
      from the runner's bookkeeping): sequence i must own exactly one run of
      ``len(ids_i)`` rows computed from ``ids_i`` at positions 0..n-1, and
      every captured row must belong to one sequence. Rows computed in
      another order (the scheduler over the token budget, the V2 runner's
      sort by token count) are returned in input order: the workers lay them
      out so (``state-transport``, told the sequences first through
      ``state-order-rpc``), else the guard re-slices them; a missing,
      duplicated, padded or unprovable row raises ``SpecShimError`` instead of
      returning misaligned training data, and the scheduler is cleared so the
      generator stays usable. Identical duplicate prompts may swap rows: they
      were computed from the same tokens, so their states are the same;
    * with prefix caching on (``extract --reuse-prefixes``), a run may start
      whole KV blocks into its sequence, where vLLM served the first blocks
      from its cache: the served rows are put back from the call or the
      earlier call that computed them (``prefix_rows``); a sequence whose rows
      cannot all be proven so is computed again whole, under a cache salt of
      its own. Nothing unproven is returned.
Upstream change:
    None by itself: it guards against the silent failure modes of every vLLM
    from 0.11 (requests over the token budget scheduled out of input order),
    of 0.12+ (chunked prefill, prefix caching) and of any future scheduling
    change.
Upstream PR:
    none: not an upstream change.
Remove when:
    speculators validates its own output alignment.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from specshim._base import SpecShimError
from specshim._prefix_reuse import chain, digest, prefix_store, reuse_block
from specshim._types import NotNeeded
from specshim.patches._declare import declare
from specshim.patches._transport import handed_states  # noqa: F401 (see below)
from specshim.patches._transport.prefix_rows import Capture, keep, stitch
from specshim.patches._transport.rows import (
    CAUSES,
    checked_record,
    match_runs,
    match_tails,
    misalignment,
    reorder,
    whole_in_input_order,
)
from specshim.patches._transport.threads import lent_threads
from specshim.patches.main import request_args

logger = logging.getLogger(__name__)
# ``handed_states`` is imported for its registration: a worker that dies
# before the first call leaves the slabs it made ahead (``prepared-slabs``),
# and its ``forget`` removes them once the generator is closed.

_REQUEST_ID = re.compile(r"^req_(\d+)_(\d+)$")


def check_inputs(token_ids: Any, vocab_size: int, max_model_len: int) -> None:
    """Raise SpecShimError for input vLLM cannot process correctly."""
    rows = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
    if rows is None or len(rows) == 0:
        raise SpecShimError("generate() got an empty batch: pass at least one sequence")
    too_long = 0
    for index, ids in enumerate(rows):
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        if len(ids) == 0:
            raise SpecShimError(
                f"sequence {index} is empty: every sequence needs at least one token"
            )
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise SpecShimError(
                f"sequence {index} has token id {bad}, outside the model's "
                f"vocabulary [0, {vocab_size}). Was it tokenized with another "
                "model's tokenizer?"
            )
        too_long += len(ids) > max_model_len - 1
    if too_long:
        logger.warning(
            "specshim: %d of %d sequences are longer than max_model_len - 1 = %d "
            "tokens; speculators truncates them to that length",
            too_long,
            len(rows),
            max_model_len - 1,
        )


def prove_rows(sequences: list[Any], record: dict[str, Any]) -> list[int]:
    """Where each sequence's rows are in the capture, proven from provenance.

    ``record`` is what the workers recorded (``row-provenance``): the token id
    and position each captured row was computed from, and the rows of each
    forward. Sequence i must own a run of exactly ``len(ids_i)`` rows computed
    at positions 0..n-1 from exactly the tokens ``ids_i``, and every captured
    row must belong to exactly one sequence. Identical duplicate prompts may
    take each other's rows: they were computed from the same tokens at the same
    positions, so their states are the same. A shared prefix is no ambiguity:
    a run is matched by its whole content and length.

    Returns the first captured row of each sequence; raises ``SpecShimError``
    naming what is missing, duplicated or unprovable.
    """
    token_ids, positions, rows = checked_record(record)
    whole = whole_in_input_order(sequences, token_ids, positions, rows)
    if whole is not None:
        return [start for start, _, _ in whole]
    found, strays = match_runs(sequences, token_ids, positions, rows)
    missing = [i for i, run in enumerate(found) if run is None]
    if missing or strays:
        raise misalignment(missing, len(strays), len(sequences))
    return [run[0] for run in found if run is not None]


def runner_order(sequences: list[Any]) -> list[int] | None:
    """The order to send ``sequences`` in so that the workers capture their
    rows in it (None: as given): by length, shortest first, ties as given.

    The V2 runner computes a step's requests shortest first (vLLM 0.22+,
    ``sort_batch_req_ids``), and the V1 runner in the order they were
    scheduled. Sent so, the rows need no reordering in the worker, so they
    can be copied out while the forward runs (``early_copies``). The order
    decides speed only: every row is proven against its own sequence, and
    the caller gets the results in its own order.
    """
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    return None if order == list(range(len(sequences))) else order


def _workers_order_rows() -> bool:
    """Whether the workers lay rows out in input order (``state-transport``
    with ``state-order-rpc``): then they are told the call's sequences."""
    from specshim._settings import disabled_ids

    return not {"all", "state-transport", "state-order-rpc"} & disabled_ids()


def _never_scheduled(generator: Any) -> int:
    """speculators' requests still waiting with nothing computed."""
    requests = generator.scheduler.requests
    return sum(
        1
        for rid, request in list(requests.items())
        if _REQUEST_ID.match(str(rid))
        and getattr(request, "num_computed_tokens", None) == 0
    )


def _abort_leftovers(generator: Any) -> int:
    from vllm.v1.request import RequestStatus

    scheduler = generator.scheduler
    leftover = [rid for rid in list(scheduler.requests) if _REQUEST_ID.match(str(rid))]
    if leftover:
        scheduler.finish_requests(leftover, RequestStatus.FINISHED_ABORTED)
    return len(leftover)


def _sequences(token_ids: Any, max_model_len: int) -> list[Any]:
    """The sequences as speculators sends them: cut to ``max_model_len - 1``."""
    rows = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
    cut = max_model_len - 1
    return [(r.tolist() if hasattr(r, "tolist") else list(r))[:cut] for r in rows]


def _call(
    self: Any,
    original: Any,
    token_ids: Any,
    sequences: list[Any],
    salted: set[int] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """speculators' ``generate()`` and the workers' provenance record of it.

    ``salted``: with the prefix cache on, the positions whose requests get a
    cache salt of their own (computed whole, see ``request_args.set_salted``);
    a request never scheduled is then an error here, as computing it again
    would not schedule it either. ``None`` where the cache is off:
    ``prove_rows`` names the sequences never scheduled.
    """
    if not hasattr(self, "_specshim_block_hasher"):
        self._specshim_block_hasher = request_args.block_hasher_for(self.vllm_config)
    request_args.set_block_hasher(self._specshim_block_hasher)
    request_args.set_salted(salted)
    if _workers_order_rows():
        self.executor.collective_rpc("_specshim_expect_rows", args=(sequences,))
    try:
        with lent_threads():  # speculators' clones of every slice
            results = original(self, token_ids)
    except Exception as exc:
        idle = _never_scheduled(self)
        _abort_leftovers(self)
        if isinstance(exc, RuntimeError) and idle == len(sequences):
            # speculators found nothing captured: no request ever ran.
            raise SpecShimError(
                f"none of the {idle} sequences could be scheduled, so no rows were "
                "computed. " + CAUSES
            ) from exc
        raise
    finally:
        request_args.set_block_hasher(None)
        request_args.set_salted(None)
    stuck = _abort_leftovers(self)
    record = _provenance(self)
    if stuck:
        logger.error("specshim: %d request(s) were never scheduled", stuck)
        if salted is not None:
            raise SpecShimError(
                f"{stuck} of {len(sequences)} sequences were never scheduled, so "
                "their rows cannot be computed. " + CAUSES
            )
    return results, record


def _provenance(self: Any) -> dict[str, Any]:
    """The workers' record of the call's rows (``row-provenance``)."""
    try:
        record = self.executor.collective_rpc(
            "_specshim_row_provenance", unique_reply_rank=0
        )[0]
    except Exception as exc:
        raise SpecShimError(
            "could not fetch the row provenance from the workers "
            f"({exc!r}); is the row-provenance-rpc patch disabled there?"
        ) from exc
    if record is None:
        raise SpecShimError(
            "the workers recorded no row provenance, so no returned row can be "
            "proven: the row-provenance patch is not applied in the workers "
            "(check SPECSHIM_DISABLE and VLLM_PLUGINS; `specshim doctor`)"
        )
    if record.get("moved"):
        logger.debug(
            "specshim: the worker moved %d run(s) of rows into input order",
            record["moved"],
        )
    return record


def _whole(self: Any, original: Any, sequences: list[Any]) -> list[dict[str, Any]]:
    """``sequences`` computed whole (each request salted), proven strictly."""
    results, record = _call(
        self, original, sequences, sequences, set(range(len(sequences)))
    )
    return reorder(results, sequences, prove_rows(sequences, record))


def _stitched(
    self: Any, original: Any, token_ids: Any, sequences: list[Any], block: int
) -> list[dict[str, Any]]:
    """``generate()`` with prefix caching on: each sequence's served rows put
    back from where they were computed (``prefix_rows``), or the sequence
    computed whole where they cannot be; only proven rows are returned."""
    store = prefix_store(self)
    salted = {i for i, ids in enumerate(sequences) if digest(ids) in store.whole}
    results, record = _call(self, original, token_ids, sequences, salted)
    ids, positions, rows = checked_record(record)
    found = whole_in_input_order(sequences, ids, positions, rows)
    if found is None:
        found, _, _ = match_tails(sequences, ids, positions, rows, block)
    # Runs no sequence owns, and sequences whose tail another head shares,
    # are in no ``found`` entry: their rows are never used.
    capture = Capture([r["hidden_states"] for r in results])
    if capture.rows != sum(rows):
        raise SpecShimError(
            f"speculators returned {capture.rows} rows where the workers "
            f"recorded {sum(rows)}"
        )
    # A sequence served nothing keeps its piece (on the slab path, the slab's
    # rows, as without the cache), so the slab stays held while the caller
    # holds that piece, through ``_whole`` below too (which then takes
    # another slab, as any call does while results are held); the pieces no
    # sequence keeps go with ``capture``.
    for result in results:
        result["hidden_states"] = None
    chains = [chain(ids, block) for ids in sequences]  # hashed once a call
    with lent_threads():  # vLLM left this process one thread; the copies want more
        complete = stitch(sequences, capture, found, block, store, chains)
    del capture
    missing = [i for i, states in enumerate(complete) if states is None]
    if missing:
        again = _whole(self, original, [sequences[i] for i in missing])
        for i, result in zip(missing, again, strict=True):
            complete[i] = result["hidden_states"]
        store.recomputed += len(missing)
    self._specshim_recomputed = missing
    for index, (result, states) in enumerate(zip(results, complete, strict=True)):
        assert states is not None
        if states[0].shape[0] != len(sequences[index]):
            raise SpecShimError(
                f"sequence {index} has {len(sequences[index])} tokens but "
                f"{states[0].shape[0]} rows after its cached rows were put back"
            )
        result["hidden_states"] = states
    keep(sequences, complete, block, store, chains)  # type: ignore[arg-type]
    return results


def _guarded(
    self: Any,
    original: Any,
    token_ids: Any,
    sequences: list[Any],
    given: list[Any] | None = None,
) -> list[dict[str, Any]]:
    """speculators' ``generate()`` of ``sequences``, every row proven;
    ``given``: the same sequences in the caller's order, which a refusal names."""
    block = reuse_block(self.vllm_config)
    if block:
        return _stitched(self, original, token_ids, sequences, block)
    results, record = _call(self, original, token_ids, sequences)
    try:
        begin = prove_rows(sequences, record)
    except SpecShimError:
        if given is not None:
            prove_rows(given, record)  # the same verdict, in the caller's indexes
        raise
    return reorder(results, sequences, begin)


def _build(original: Any) -> Any:
    import functools

    @functools.wraps(original)
    def generate(self: Any, token_ids: Any) -> list[dict[str, Any]]:
        model_config = self.vllm_config.model_config
        check_inputs(
            token_ids, model_config.get_vocab_size(), model_config.max_model_len
        )
        sequences = _sequences(token_ids, model_config.max_model_len)
        order = runner_order(sequences)
        if order is None:
            return _guarded(self, original, token_ids, sequences)
        ran = [sequences[i] for i in order]
        back: list[Any] = [None] * len(order)
        for result, index in zip(
            _guarded(self, original, ran, ran, sequences), order, strict=True
        ):
            back[index] = result
        return back

    generate.__specshim__ = True  # type: ignore[attr-defined]
    return generate


def _probe(original: Any) -> None:
    if original is None:
        raise NotNeeded("no generate()")


PATCH = declare(
    __name__,
    __doc__,
    id="generate-guard",
    attribute="VllmHiddenStatesGenerator.generate",
    versions=">=0.11",
    probe=_probe,
    build=_build,
)
