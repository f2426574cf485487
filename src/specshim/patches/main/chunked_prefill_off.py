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

from specshim._types import NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import force_keyword, keyword_default


def _probe(original: Any) -> None:
    if keyword_default(original, "enable_chunked_prefill", required=True) is not True:
        raise NotNeeded("chunked prefill is off by default")


PATCH = declare(
    __name__,
    __doc__,
    id="chunked-prefill-off",
    attribute="SchedulerConfig",
    versions=">=0.12",
    probe=_probe,
    build=force_keyword("enable_chunked_prefill", False),
    drift_rows=(2,),
)
