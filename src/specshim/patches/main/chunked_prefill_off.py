"""Chunked prefill off in the generator's SchedulerConfig (correctness guard).

Why:
    speculators' loop schedules a step, runs it, then aborts every scheduled
    request (``finish_requests(..., FINISHED_ABORTED)``): it assumes each
    request is prefilled whole in one step. vLLM turned chunked prefill on by
    default, so a batch over ``max_num_batched_tokens`` gets a *partial*
    prefill for its last request, which is then aborted: truncated hidden
    states, every later row shifted, and no error. With chunked prefill off the
    scheduler stops at the first request that does not fit and schedules it
    whole in the next step.
Upstream change:
    vLLM 0.12: ``SchedulerConfig.enable_chunked_prefill`` defaults to True.
Upstream PR:
    vllm-project/vllm#28665 (SchedulerConfig's defaults move into the
    class).
Remove when:
    speculators passes ``enable_chunked_prefill=False`` itself, or its loop
    stops aborting partially prefilled requests.
"""

from __future__ import annotations

from typing import Any

from specshim._types import Incompatible, NotNeeded
from specshim.patches._util import adapt_kwargs, declare, parameters


def _probe(original: Any) -> None:
    params = parameters(original)
    if "enable_chunked_prefill" not in params:
        raise Incompatible(
            "SchedulerConfig(..., enable_chunked_prefill=...)",
            "no enable_chunked_prefill parameter",
        )
    if params["enable_chunked_prefill"].default is not True:
        raise NotNeeded("chunked prefill is off by default")


def _off(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs["enable_chunked_prefill"] = False
    return kwargs


PATCH = declare(
    __name__,
    __doc__,
    id="chunked-prefill-off",
    attribute="SchedulerConfig",
    versions=">=0.12",
    probe=_probe,
    build=lambda original: adapt_kwargs(original, _off),
    drift_rows=(2,),
)
