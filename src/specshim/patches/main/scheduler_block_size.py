"""``Scheduler`` needs ``block_size``.

Why:
    speculators builds ``Scheduler(vllm_config=, kv_cache_config=,
    structured_output_manager=)``. vLLM added a required ``block_size``, so the
    call fails with ``TypeError: missing 1 required positional argument:
    'block_size'``. The value is what vLLM's own EngineCore passes:
    ``cache_config.block_size * decode_context_parallel_size *
    prefill_context_parallel_size``. ``mm_registry`` defaults to the global
    registry, as in EngineCore.
Upstream change:
    vLLM 0.12: ``vllm.v1.core.sched.scheduler.Scheduler(..., block_size)``.
Remove when:
    speculators passes ``block_size`` itself.
"""

from __future__ import annotations

from typing import Any

from specshim._registry import NotNeeded, Patch, register
from specshim.patches._util import GENERATOR, adapt_kwargs, parameters


def scheduler_block_size(vllm_config: Any) -> int:
    parallel = vllm_config.parallel_config
    return int(
        vllm_config.cache_config.block_size
        * getattr(parallel, "decode_context_parallel_size", 1)
        * getattr(parallel, "prefill_context_parallel_size", 1)
    )


def _probe(original: Any) -> None:
    if "block_size" not in parameters(original):
        raise NotNeeded("Scheduler takes no block_size")


def _fill(kwargs: dict[str, Any]) -> dict[str, Any]:
    if "block_size" not in kwargs:
        kwargs["block_size"] = scheduler_block_size(kwargs["vllm_config"])
    return kwargs


PATCH = register(
    Patch(
        id="scheduler-block-size",
        process="main",
        module=GENERATOR,
        attribute="Scheduler",
        package="vllm",
        versions=">=0.12",
        probe=_probe,
        build=lambda original: adapt_kwargs(original, _fill),
        why=__doc__ or "",
        upstream="vLLM 0.12: Scheduler(..., block_size) is required",
        remove_when="speculators passes block_size",
        drift_rows=(5,),
    )
)
