"""The KV cache layout resolved as vLLM's engine core does, before speculators
sizes its KV cache.

Why:
    vLLM 0.29 made the KV cache layout an engine-wide decision: the engine
    core asks every worker which layouts its attention backends support,
    resolves one (``resolve_kv_cache_layout``), records it on the config and
    sends it to the workers (``set_kv_cache_layout``), all before it builds the
    KV cache config. ``get_kv_cache_config_from_groups`` now reads that layout
    and refuses an unresolved one: "KV cache layout has not been resolved yet".
    speculators drives the executor without an engine core, so its generator
    fails while it is being built. speculators' view of the executor resolves
    the layout right after the executor is constructed (its workers have
    loaded the model, as when the engine core does it), with the same
    function, the workers' own supported layouts and their KV cache specs. A
    layout the user set (``VLLM_KV_CACHE_LAYOUT``) is honoured by that
    function as in vLLM.
Upstream change:
    vLLM 0.29: ``CacheConfig.kv_cache_layout`` resolved by the engine core
    (``resolve_kv_cache_layout``, ``Executor.set_kv_cache_layout``);
    ``get_kv_cache_config_from_groups`` refuses it unresolved.
Upstream PR:
    not found.
Remove when:
    speculators resolves the KV cache layout (or builds on vLLM's engine core).
"""

from __future__ import annotations

import importlib
from typing import Any

from specshim._types import Incompatible, NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import upstream, wrap

_RESOLVER = "vllm.v1.attention.backends.utils"


def _probe(original: Any) -> None:
    resolver = importlib.import_module(_RESOLVER)
    if getattr(resolver, "resolve_kv_cache_layout", None) is None:
        raise NotNeeded("vLLM has no engine-wide KV cache layout to resolve")
    cls = upstream(original)
    for method in ("get_kv_cache_specs", "get_supported_kv_cache_layouts"):
        if not callable(getattr(cls, method, None)):
            raise Incompatible(f"MultiprocExecutor.{method}", "no such method")
    if not callable(getattr(cls, "set_kv_cache_layout", None)):
        raise Incompatible("MultiprocExecutor.set_kv_cache_layout", "no such method")


def resolve_layout(executor: Any) -> Any:
    """What the engine core does before it sizes the KV cache."""
    resolve = importlib.import_module(_RESOLVER).resolve_kv_cache_layout
    specs = executor.get_kv_cache_specs()
    layout = resolve(
        executor.vllm_config,
        executor.get_supported_kv_cache_layouts(),
        [spec for worker in specs for spec in worker.values()],
    )
    executor.set_kv_cache_layout(layout.name)
    return executor


PATCH = declare(
    __name__,
    __doc__,
    id="kv-cache-layout",
    attribute="MultiprocExecutor",
    versions=">=0.29",
    probe=_probe,
    drift_rows=(24,),
    build=lambda original: wrap(
        original, lambda cls, args, kwargs: resolve_layout(cls(*args, **kwargs))
    ),
)
