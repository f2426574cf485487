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
Remove when:
    speculators passes ``async_scheduling=False`` itself.
"""

from __future__ import annotations

from typing import Any

from specshim._registry import NotNeeded, Patch, register
from specshim.patches._util import GENERATOR, adapt_kwargs, parameters


def _probe(original: Any) -> None:
    params = parameters(original)
    if "async_scheduling" not in params or params["async_scheduling"].default is False:
        raise NotNeeded("async scheduling is never enabled implicitly")


def _off(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs["async_scheduling"] = False
    return kwargs


PATCH = register(
    Patch(
        id="async-scheduling-off",
        process="main",
        module=GENERATOR,
        attribute="SchedulerConfig",
        package="vllm",
        versions=">=0.14",
        probe=_probe,
        build=lambda original: adapt_kwargs(original, _off),
        why=__doc__ or "",
        upstream="vLLM 0.14: async_scheduling resolved to True automatically",
        remove_when="speculators passes async_scheduling=False",
        drift_rows=(10,),
    )
)
