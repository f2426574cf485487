"""Where an ``extract`` run's time went, logged as its closing lines (the
run's own profile, first thing to read when it is slow; the benches parse
them: ``benchmarks/plan.py``)."""

from __future__ import annotations

import logging
from typing import Any

from specshim._moved import tally

logger = logging.getLogger("specshim.job.extract.command")


def where_time_went(
    seconds: float, calls: list[float], handing: float, finishing: float, writer: Any
) -> dict[str, float]:
    """Log and return the run's ``seconds`` after its first ``generate()``,
    split: the ``calls`` (each one's seconds), ``handing`` batches to the
    ``writer`` (its own idle, serializing and committing seconds beside),
    ``finishing`` (the writer's backlog after the last call) and the rest,
    between calls in the main thread (the feed, the checks)."""
    generating = sum(calls)
    timing = {
        "generate": generating,
        "waiting_for_writer": handing,
        "writer_idle": writer.idle,
        "writer_serializing": writer.serializing,
        "writer_committing": writer.committing,
        "writer_syncs": writer.syncs,
        "finishing": max(finishing, 0.0),
    }
    timing["between_calls"] = max(
        seconds - generating - handing - timing["finishing"], 0.0
    )
    logger.info(
        "extract: of %.1f s after the first generate(): generate() %.1f s, "
        "handing batches to the writer %.1f s; the writer waited for "
        "batches %.1f s, for its %d threads' files %.1f s, and committed "
        "%.1f s (%d fsyncs of the manifest)",
        seconds,
        generating,
        handing,
        writer.idle,
        writer.threads,
        writer.serializing,
        writer.committing,
        writer.syncs,
    )
    logger.info(
        "extract: after its last generate() the writer took %.2f s to finish; "
        "between calls (the feed, the checks) %.2f s",
        timing["finishing"],
        timing["between_calls"],
    )
    timing |= _transport()
    if calls:
        # Warm-up (first-seen step shapes, slabs made) against the steady
        # pace: the first call, the median, the slowest.
        ordered = sorted(calls)
        timing |= {
            "generate_first": calls[0],
            "generate_median": ordered[len(ordered) // 2],
            "generate_slowest": ordered[-1],
        }
        logger.info(
            "extract: its %d generate() calls took %.3f s (the first), "
            "%.3f s (the median), %.3f s (the slowest)",
            len(calls),
            calls[0],
            timing["generate_median"],
            timing["generate_slowest"],
        )
    return timing


def _transport() -> dict[str, float]:
    """How the states came to this process: the shared slabs its workers
    made (more than ``extract`` prepares means some were made on the calls'
    path), and what came through vLLM's queue (no free slab). Logged where
    the state transport ran at all."""
    moved = tally()
    if not (moved["slabs"] or moved["queued_bytes"]):
        return {}
    logger.info(
        "extract: the states came through %d shared slabs, and %.2f GB of "
        "them through vLLM's queue",
        moved["slabs"],
        moved["queued_bytes"] / 1e9,
    )
    return {"slabs": moved["slabs"], "queued_gb": moved["queued_bytes"] / 1e9}
