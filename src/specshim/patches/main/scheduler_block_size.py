"""``Scheduler`` needs ``block_size``.

Why:
    speculators builds ``Scheduler(vllm_config=, kv_cache_config=,
    structured_output_manager=)``. vLLM added a required ``block_size``, so the
    call fails with ``TypeError: missing 1 required positional argument:
    'block_size'``. The value is what vLLM's own EngineCore passes:
    ``cache_config.block_size * decode_context_parallel_size *
    prefill_context_parallel_size``. ``mm_registry`` defaults to the global
    registry, as in EngineCore. From vLLM 0.20 EngineCore takes both the
    scheduler's block size and the block-hash granularity
    (``hash_block_size``) from ``resolve_kv_cache_block_sizes(kv_cache_config,
    vllm_config)``, which differs from the formula above only for models with
    several KV-cache groups of different block sizes; where that helper
    exists, this patch passes what it returns, for both.
Upstream change:
    vLLM 0.12: ``vllm.v1.core.sched.scheduler.Scheduler(..., block_size)``;
    0.20: ``Scheduler(..., hash_block_size=None)`` and
    ``kv_cache_utils.resolve_kv_cache_block_sizes``.
Upstream PR:
    not found (vllm-project/speculators#225 names the 0.12 change but no
    PR).
Remove when:
    speculators passes ``block_size`` itself.
"""

from __future__ import annotations

from typing import Any

from specshim._prefix_reuse import scheduler_block_size
from specshim._types import NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import adapt_kwargs, parameters


def block_sizes(vllm_config: Any, kv_cache_config: Any) -> tuple[int, int]:
    """(scheduler block size, hash block size), as this vLLM's EngineCore has them."""
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    except ImportError:  # before 0.20: one block size for both
        size = scheduler_block_size(vllm_config)
        return size, size
    scheduler, hashing = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return int(scheduler), int(hashing)


def _probe(original: Any) -> None:
    if "block_size" not in parameters(original):
        raise NotNeeded("Scheduler takes no block_size")


def _adapt(params: dict[str, Any]) -> Any:
    def fill(kwargs: dict[str, Any]) -> dict[str, Any]:
        if "block_size" in kwargs:
            return kwargs
        size, hashing = block_sizes(kwargs["vllm_config"], kwargs["kv_cache_config"])
        kwargs["block_size"] = size
        if "hash_block_size" in params:
            kwargs.setdefault("hash_block_size", hashing)
        return kwargs

    return fill


PATCH = declare(
    __name__,
    __doc__,
    id="scheduler-block-size",
    attribute="Scheduler",
    versions=">=0.12",
    probe=_probe,
    build=lambda original: adapt_kwargs(original, _adapt(parameters(original))),
    drift_rows=(5, 17),
)
