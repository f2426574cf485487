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
Remove when:
    speculators stops passing ``kv_cache_specs``.
"""

from __future__ import annotations

from typing import Any

from specshim._registry import Incompatible, NotNeeded, Patch, register
from specshim.patches._util import GENERATOR, adapt_kwargs, parameters, signature_text

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


PATCH = register(
    Patch(
        id="kv-cache-config-args",
        process="main",
        module=GENERATOR,
        attribute="get_kv_cache_config_from_groups",
        package="vllm",
        versions=">=0.12",
        probe=_probe,
        build=lambda original: adapt_kwargs(original, _drop),
        why=__doc__ or "",
        upstream="vLLM 0.12: kv_cache_specs parameter removed",
        remove_when="speculators stops passing kv_cache_specs",
        drift_rows=(4,),
    )
)
