"""``Request`` arguments: ``eos_token_id`` gone from vLLM 0.17; block hashes.

Why:
    speculators builds ``Request(request_id=, prompt_token_ids=,
    sampling_params=, pooling_params=, eos_token_id=, arrival_time=)``.
    vLLM 0.17.0 (first in a 0.16 nightly) dropped ``eos_token_id`` from the
    constructor (``TypeError: unexpected keyword argument 'eos_token_id'``);
    the 0.16.0 release still takes it, and the argument is dropped only where
    the constructor has no such parameter. speculators also passes no
    ``block_hasher``, which leaves ``request.block_hashes`` empty: harmless
    with prefix caching off (the ``prefix-caching-off`` patch), but with
    caching on the block pool asserts ``len(request.block_hashes) >=
    num_full_blocks``. When the
    generator's cache config has caching on, requests get the hasher vLLM's
    EngineCore would give them: ``get_request_block_hasher(block_size,
    hash_fn)`` after ``init_none_hash(hash_fn)``.
Upstream change:
    vLLM 0.12: ``Request(..., block_hasher=)``; 0.17.0 (a 0.16 nightly
    before it): no ``eos_token_id`` (the eos id moved into the sampling
    params).
Upstream PR:
    vllm-project/vllm#34435 (``Request.eos_token_id`` moves to
    ``SamplingParams``); the 0.12 ``block_hasher`` change: not found.
Remove when:
    speculators builds requests the way EngineCore does
    (``Request.from_engine_core_request`` with the engine's block hasher).
"""

from __future__ import annotations

import threading
from typing import Any

from specshim._base import SpecShimError
from specshim._types import NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import adapt_kwargs, parameters

# The generator sets this while it builds a scheduler with prefix caching on;
# see ``block_hasher_for``. One generator per process is the norm, but keep it
# per thread so two generators in two threads do not mix hashers.
_local = threading.local()


def block_hasher_for(vllm_config: Any) -> Any:
    """The request block hasher EngineCore would build, or None if caching is off."""
    cache = vllm_config.cache_config
    if not getattr(cache, "enable_prefix_caching", False):
        return None
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    from specshim._prefix_reuse import scheduler_block_size

    hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(scheduler_block_size(vllm_config), hash_fn)


def set_block_hasher(hasher: Any) -> None:
    _local.hasher = hasher


def set_salted(positions: set[int] | None) -> None:
    """The positions in the next ``generate()`` call whose requests get a
    cache salt of their own: nothing is served to them from the prefix cache,
    and nothing they compute is served to another (they are computed whole)."""
    _local.salted = positions


def _salt(request_id: Any) -> str | None:
    salted = getattr(_local, "salted", None)
    if not salted:
        return None
    # speculators names its requests req_{call}_{position in the call}
    _, _, position = str(request_id).rpartition("_")
    if not position.isdigit():  # a salt missed is a sequence served unseen
        raise SpecShimError(
            f"prefix reuse: request id {request_id!r} names no position in the "
            "call, so the sequences to compute whole cannot be salted; run "
            "without --reuse-prefixes (SPECSHIM_REUSE_PREFIXES)"
        )
    if int(position) in salted:
        return f"specshim-whole-{request_id}"
    return None


def _probe(original: Any) -> None:
    params = parameters(original)
    if "eos_token_id" in params and "block_hasher" not in params:
        raise NotNeeded("Request takes eos_token_id and has no block hashes")
    if "eos_token_id" in params and not _prefix_caching_on_by_default():
        raise NotNeeded("Request takes eos_token_id and prefix caching is opt-in")


def _prefix_caching_on_by_default() -> bool:
    from vllm.config import CacheConfig

    param = parameters(CacheConfig).get("enable_prefix_caching")
    return param is not None and param.default is True


def _adapt(params: dict[str, Any]) -> Any:
    def adapt(kwargs: dict[str, Any]) -> dict[str, Any]:
        if "eos_token_id" not in params:
            kwargs.pop("eos_token_id", None)
        hasher = getattr(_local, "hasher", None)
        if hasher is not None and "block_hasher" in params:
            kwargs.setdefault("block_hasher", hasher)
        salt = _salt(kwargs.get("request_id"))
        if salt is not None:
            if hasher is None or not {"block_hasher", "cache_salt"} <= set(params):
                raise SpecShimError(
                    "prefix reuse: this vLLM's Request takes no cache_salt (or "
                    "no block hasher), so a sequence to compute whole could be "
                    "served from the cache; run without --reuse-prefixes "
                    "(SPECSHIM_REUSE_PREFIXES)"
                )
            kwargs["cache_salt"] = salt
        return kwargs

    return adapt


PATCH = declare(
    __name__,
    __doc__,
    id="request-args",
    attribute="Request",
    versions=">=0.12",
    probe=_probe,
    build=lambda original: adapt_kwargs(original, _adapt(parameters(original))),
    drift_rows=(6, 15),
    requires=("generate-guard",),  # it sets the block hasher (set_block_hasher)
)
