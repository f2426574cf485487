"""``get_kv_cache_config_from_groups`` lost its ``kv_cache_specs`` argument.

Why:
    speculators calls ``get_kv_cache_config_from_groups(vllm_config=,
    kv_cache_groups=, kv_cache_specs=, available_memory=)``. vLLM removed
    ``kv_cache_specs`` (the groups carry their specs), so the call fails with
    ``TypeError: ... unexpected keyword argument 'kv_cache_specs'``. Dropping it
    is exact: the removed argument was redundant with ``kv_cache_groups``.
Upstream change:
    vLLM 0.12: ``kv_cache_specs`` removed from
    ``vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups``.
Upstream PR:
    not found (vllm-project/speculators#225 names the change but no PR).
Remove when:
    speculators stops passing ``kv_cache_specs``.
"""

from __future__ import annotations

from typing import Any

from specshim._types import Incompatible, NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import adapt_kwargs, parameters, signature_text

_EXPECTED = ("vllm_config", "kv_cache_groups", "available_memory")


def _probe(original: Any) -> None:
    params = parameters(original)
    if "kv_cache_specs" in params:
        raise NotNeeded("get_kv_cache_config_from_groups still takes kv_cache_specs")
    if not all(name in params for name in _EXPECTED):
        raise Incompatible(
            "get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, "
            "available_memory)",
            signature_text(original),
        )


def _drop(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs.pop("kv_cache_specs", None)
    return kwargs


PATCH = declare(
    __name__,
    __doc__,
    id="kv-cache-config-args",
    attribute="get_kv_cache_config_from_groups",
    versions=">=0.12",
    probe=_probe,
    build=lambda original: adapt_kwargs(original, _drop),
    drift_rows=(4,),
)
