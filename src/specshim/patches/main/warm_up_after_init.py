"""``initialize_from_config`` followed by ``compile_or_warm_up_model``.

Why:
    speculators builds its executor by hand and calls
    ``executor.initialize_from_config(kv_cache_configs)`` once, trusting it to
    warm the workers up as vLLM 0.11 did. vLLM 0.27 moved the warm-up out: the
    executor only allocates the KV caches, and vLLM's own engine calls
    ``compile_or_warm_up_model()`` itself right after. Under speculators the
    workers then never warm up: on a GPU no warm-up forwards, kernel JIT,
    CUDA-graph capture (unless eager) or sampler buffer preallocation happen
    before the first real step; on the CPU backend only the seed reset is
    skipped. speculators' view of the executor calls ``compile_or_warm_up_model``
    right after ``initialize_from_config``, in the same place the warm-up ran
    before 0.27 (after speculators installed its capture, which ``generate``
    resets before every call). vLLM's own engine is untouched.
Upstream change:
    vLLM 0.27: ``Executor.initialize_from_config`` no longer calls
    ``compile_or_warm_up_model``; ``EngineCore`` calls it.
Upstream PR:
    not found.
Remove when:
    speculators calls ``compile_or_warm_up_model`` itself after
    ``initialize_from_config``.
"""

from __future__ import annotations

import inspect
from typing import Any

from specshim._types import Incompatible, NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import upstream, view_method


def initialize_from_config(executor: Any, kv_cache_configs: Any) -> Any:
    result = executor.initialize_from_config(kv_cache_configs)
    executor.compile_or_warm_up_model()
    return result


def _probe(original: Any) -> None:
    cls = upstream(original)
    init = getattr(cls, "initialize_from_config", None)
    if init is None:
        raise Incompatible("MultiprocExecutor.initialize_from_config", "no such method")
    try:
        source = inspect.getsource(init)
    except (OSError, TypeError) as exc:
        raise Incompatible("the source of initialize_from_config", repr(exc)) from exc
    if "compile_or_warm_up_model" in source:
        raise NotNeeded("initialize_from_config warms the workers up itself")
    if not callable(getattr(cls, "compile_or_warm_up_model", None)):
        raise Incompatible(
            "MultiprocExecutor.compile_or_warm_up_model (the warm-up moved there)",
            "no such method, and initialize_from_config does not warm up",
        )


PATCH = declare(
    __name__,
    __doc__,
    id="warm-up-after-init",
    attribute="MultiprocExecutor",
    versions=">=0.27",
    probe=_probe,
    build=lambda original: view_method(
        original, "initialize_from_config", initialize_from_config
    ),
    drift_rows=(20,),
)
