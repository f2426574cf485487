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
    * after the call, checks every sequence against the layout the workers
      recorded (which request's tokens sit in which captured rows, see the
      worker patch ``captured-layout-rpc``): every request computed whole,
      exactly once. If the rows are complete but in another order it re-slices
      them by request; if anything is missing it raises ``SpecShimError``
      instead of returning misaligned training data, and clears the scheduler
      so the generator stays usable.
Upstream change:
    None by itself: it guards against the silent failure modes of every vLLM
    from 0.11 (requests over the token budget scheduled out of input order),
    of 0.12+ (chunked prefill, prefix caching) and of any future scheduling
    change.
Remove when:
    speculators validates its own output alignment.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from specshim._registry import NotNeeded, Patch, SpecShimError, register
from specshim.patches._util import GENERATOR
from specshim.patches.main import request_args

logger = logging.getLogger(__name__)

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


def check_shapes(results: list[dict[str, Any]]) -> None:
    """Without a worker layout: at least every sequence must have all its rows."""
    for index, result in enumerate(results):
        n = len(result["input_ids"])
        for layer, states in enumerate(result["hidden_states"]):
            if states.shape[0] != n:
                raise SpecShimError(
                    f"sequence {index} has {n} tokens but {states.shape[0]} captured "
                    f"rows for its layer #{layer}: the rows are misaligned"
                )


def realign(
    results: list[dict[str, Any]], layout: list[tuple[str, int]], counter: int
) -> list[dict[str, Any]]:
    """Check ``results`` against the worker's row layout; re-slice if reordered.

    ``layout`` lists (request id, rows) in the order the rows were captured.
    """
    import torch

    expected = {
        f"req_{counter}_{i}": len(r["input_ids"]) for i, r in enumerate(results)
    }
    mine = [(rid, n) for rid, n in layout if rid in expected]
    seen: dict[str, int] = {}
    for rid, n in mine:
        seen[rid] = seen.get(rid, 0) + n
    problems = [
        f"{rid}: {seen.get(rid, 0)} of {n} tokens computed"
        for rid, n in expected.items()
        if seen.get(rid, 0) != n
    ]
    repeated = len(mine) != len(seen)
    if problems or repeated:
        detail = "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else "")
        if repeated:
            detail += " (some request was computed in more than one step)"
        raise SpecShimError(
            "hidden states do not line up with the input sequences: " + detail + ". "
            "Returning them would misalign training data. Typical causes: a "
            "sequence needs more KV-cache blocks than exist (raise "
            "gpu_memory_utilization or VLLM_CPU_KVCACHE_SPACE), or a disabled "
            "specshim guard (chunked-prefill-off, prefix-caching-off)."
        )
    order = [rid for rid, _ in mine]
    if order == list(expected):
        return results
    logger.warning("specshim: captured rows were out of input order; re-sliced them")
    num_layers = len(results[0]["hidden_states"])
    stacked = [
        torch.cat([r["hidden_states"][k] for r in results]) for k in range(num_layers)
    ]
    start: dict[str, int] = {}
    offset = 0
    for rid, n in mine:
        start[rid] = offset
        offset += n
    for i, result in enumerate(results):
        rid = f"req_{counter}_{i}"
        n = expected[rid]
        begin = start[rid]
        result["hidden_states"] = [h[begin : begin + n].clone() for h in stacked]
    return results


def _abort_leftovers(generator: Any) -> int:
    from vllm.v1.request import RequestStatus

    scheduler = generator.scheduler
    leftover = [rid for rid in list(scheduler.requests) if _REQUEST_ID.match(str(rid))]
    if leftover:
        scheduler.finish_requests(leftover, RequestStatus.FINISHED_ABORTED)
    return len(leftover)


def _build(original: Any) -> Any:
    import functools

    @functools.wraps(original)
    def generate(self: Any, token_ids: Any) -> list[dict[str, Any]]:
        model_config = self.vllm_config.model_config
        check_inputs(
            token_ids, model_config.get_vocab_size(), model_config.max_model_len
        )
        if not hasattr(self, "_specshim_block_hasher"):
            self._specshim_block_hasher = request_args.block_hasher_for(
                self.vllm_config
            )
        request_args.set_block_hasher(self._specshim_block_hasher)
        counter = self._request_counter
        try:
            results = original(self, token_ids)
        except Exception:
            _abort_leftovers(self)
            raise
        finally:
            request_args.set_block_hasher(None)
        stuck = _abort_leftovers(self)
        layout = self.executor.collective_rpc(
            "_specshim_captured_layout", unique_reply_rank=0
        )[0]
        if stuck:
            logger.error("specshim: %d request(s) were never scheduled", stuck)
        if layout is None:
            check_shapes(results)
            return results
        return realign(results, [tuple(x) for x in layout], counter)

    generate.__specshim__ = True  # type: ignore[attr-defined]
    return generate


def _probe(original: Any) -> None:
    if original is None:
        raise NotNeeded("no generate()")


PATCH = register(
    Patch(
        id="generate-guard",
        process="main",
        module=GENERATOR,
        attribute="VllmHiddenStatesGenerator.generate",
        package="vllm",
        versions=">=0.11",
        probe=_probe,
        build=_build,
        why=__doc__ or "",
        upstream="none: guards speculators' positional slicing",
        remove_when="speculators validates its output alignment",
    )
)
