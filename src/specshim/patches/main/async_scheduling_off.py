"""Async scheduling off in the generator's SchedulerConfig.

Why:
    speculators drives a plain ``Scheduler`` by hand, one step at a time, and
    never consumes model-runner outputs. vLLM turns ``async_scheduling`` on by
    itself on GPU with the multiprocessing executor, which makes the workers
    overlap steps and expects the async scheduler's bookkeeping. Nothing in
    speculators was written or tested for that; pass ``async_scheduling=False``.
Upstream change:
    vLLM 0.14: ``async_scheduling`` defaults to None and is resolved to True on
    supported platforms.
Upstream PR:
    vllm-project/vllm#27614 (async scheduling on by default).
Remove when:
    speculators passes ``async_scheduling=False`` itself.
"""

from __future__ import annotations

from typing import Any

from specshim._types import NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import force_keyword, keyword_default


def _probe(original: Any) -> None:
    if keyword_default(original, "async_scheduling", required=False) is False:
        raise NotNeeded("async scheduling is never enabled implicitly")


PATCH = declare(
    __name__,
    __doc__,
    id="async-scheduling-off",
    attribute="SchedulerConfig",
    versions=">=0.14",
    probe=_probe,
    build=force_keyword("async_scheduling", False),
    drift_rows=(10,),
)
