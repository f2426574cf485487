"""``extract --reuse-prefixes``: the feed in the plan's order, the generator's
store of prefix rows sized by the plan, and what the run says of both.

The plan (``prefixes``) needs every sample's tokens before the first forward,
so the run reads the whole shard first: 4 bytes a token, held until written.
What the cache served, and what had to be computed whole, is read back from
the generator (``generate-guard`` with ``prefix_rows``), never assumed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from specshim.job.extract.feed import Todo
from specshim.job.extract.prefixes import PrefixPlan, plan_prefixes

logger = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass
class Reuse:
    """What one run planned and what its generator did."""

    plan: PrefixPlan | None  # None: the cache stayed off
    store: Any = None  # the generator's PrefixRows
    recomputed: list[int] = field(default_factory=list)  # dataset indexes

    def after(self, generator: Any, batch: list[Todo]) -> None:
        """Note the samples of ``batch`` the generator computed whole."""
        for position in getattr(generator, "_specshim_recomputed", None) or []:
            self.recomputed.append(batch[position].index)

    def report(self) -> dict[str, Any]:
        """The counts ``extract`` returns, logged as one line."""
        if self.plan is None or self.store is None:
            return {"reuse": None}
        store = self.store
        total = store.served_tokens + store.computed_tokens
        counts = {
            "served_tokens": store.served_tokens,
            "computed_tokens": store.computed_tokens,
            "planned_tokens": self.plan.reused_tokens,
            "held_peak_bytes": store.peak_bytes,
            "cap_bytes": store.cap_bytes,
            "cut": len(self.plan.cut),
            "recomputed": sorted(self.recomputed),
            "stitch_seconds": round(store.stitch_seconds, 3),
            "keep_seconds": round(store.keep_seconds, 3),
            "copied_bytes": store.copied_bytes,
            "faults": store.faults,
        }
        logger.info(
            "extract: prefix reuse served %d of %d tokens from the cache (%.0f%%; "
            "the plan expected %d); prefix rows held at most %.1f MiB of %.1f MiB",
            store.served_tokens,
            total,
            100 * store.served_tokens / total if total else 0.0,
            self.plan.reused_tokens,
            store.peak_bytes / MIB,
            store.cap_bytes / MIB,
        )
        copying = store.stitch_seconds + store.keep_seconds
        logger.info(
            "extract: prefix reuse: the main process put served rows back in "
            "%.2f s and kept blocks in %.2f s, copying %.2f GB (%.1f GB/s; %d page "
            "faults meanwhile)",
            store.stitch_seconds,
            store.keep_seconds,
            store.copied_bytes / 1e9,
            store.copied_bytes / 1e9 / copying if copying else 0.0,
            store.faults,
        )
        if self.recomputed:
            shown = ", ".join(str(i) for i in sorted(self.recomputed)[:10])
            more = " ..." if len(self.recomputed) > 10 else ""
            logger.info(
                "extract: prefix reuse computed %d sample(s) whole, their cached "
                "rows found nowhere (evicted, or over the cap): %s%s",
                len(self.recomputed),
                shown,
                more,
            )
        return {"reuse": counts}


def bytes_per_token(generator: Any, layers: int) -> int:
    """The captured rows' bytes per token: every layer's hidden state."""
    import torch

    model = generator.vllm_config.model_config
    width = torch.empty((), dtype=model.dtype).element_size()
    return layers * model.get_hidden_size() * width


def shard_note(shard: tuple[int, int]) -> str | None:
    """What a run of one shard of several should know: it plans only its own
    samples, and sharers that fall to other shards compute their prefix
    again."""
    index, count = shard
    if count < 2:
        return None
    return (
        f"extract: --reuse-prefixes plans within shard {index}/{count} only "
        f"(samples i % {count} == {index}): a prefix is computed again in every "
        "shard that has samples sharing it, so sharers that sit next to each "
        "other (responses to one prompt, turns of one conversation) mostly lose "
        f"it; fewer, larger shards (--tp) keep more, as does a dataset that puts "
        f"such samples {count} apart"
    )


def planned(
    todos: list[Todo],
    generator: Any,
    layers: int,
    cap_mib: int | None,
    shard: tuple[int, int] = (0, 1),
) -> tuple[list[Todo], Reuse]:
    """``todos`` in the plan's order, and the run's ``Reuse`` (the generator
    given its store); unchanged where this vLLM kept the cache off."""
    from specshim._prefix_reuse import PrefixRows, digest, give_store, reuse_block

    note = shard_note(shard)
    if note:
        logger.warning(note)

    block = reuse_block(generator.vllm_config)
    if not block:
        logger.warning(
            "extract: --reuse-prefixes: this vLLM's prefix cache stayed off "
            "(its CacheConfig has no such default to force); every token is "
            "computed, as without the flag"
        )
        return todos, Reuse(None)
    cap = None if cap_mib is None else cap_mib * MIB
    plan = plan_prefixes(
        ((i, todo.input_ids) for i, todo in enumerate(todos)),
        block,
        bytes_per_token(generator, layers),
        cap,
    )
    store = PrefixRows(
        plan.peak_bytes if cap is None else cap,
        uses=dict(plan.uses),
        whole={digest(todos[i].input_ids) for i in plan.cut},
        pieces=True,  # the writer writes a served sample from its pieces
    )
    give_store(generator, store)
    tokens = sum(len(todo) for todo in todos)
    logger.info(
        "extract: prefix reuse planned %d of %d tokens (%.0f%%) from the cache, "
        "%d-token blocks; prefix rows to hold: %.1f MiB%s",
        plan.reused_tokens,
        tokens,
        100 * plan.reused_tokens / tokens if tokens else 0.0,
        block,
        plan.peak_bytes / MIB,
        "" if cap is None else f" (cap {cap_mib} MiB)",
    )
    if plan.cut:
        logger.info(
            "extract: %d sample(s) share prefixes whose rows would exceed "
            "--reuse-cap-mib %d: computed whole",
            len(plan.cut),
            cap_mib,
        )
    return [todos[i] for i in plan.order], Reuse(plan, store)
