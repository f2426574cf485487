"""Prefix caching off in the generator's CacheConfig (correctness guard).

Why:
    speculators captures hidden states of the tokens the model *computes*. With
    prefix caching on, a shared system prompt or a duplicate prompt hits the
    cache and its rows are never computed: those sequences come back with
    missing rows and every later sequence is shifted, with no error. (Without a
    block hasher it fails instead with ``assert len(request.block_hashes) >=
    num_full_blocks`` in block_pool; adding a hasher alone turns that loud
    failure into the silent one.) Extraction must compute every token.
Upstream change:
    vLLM 0.12: ``CacheConfig.enable_prefix_caching`` defaults to True.
Upstream PR:
    vllm-project/vllm#29186 (``enable_prefix_caching`` is no longer None by
    default).

    With ``SPECSHIM_REUSE_PREFIXES=1`` (``extract --reuse-prefixes`` sets it
    while the generator starts), caching is forced on instead:
    ``generate-guard`` then reads which rows the cache served and puts them
    back from the rows of the tokens that computed them (``prefix_rows``), or
    computes the sequence whole.
Remove when:
    speculators passes ``enable_prefix_caching=False`` itself.
"""

from __future__ import annotations

from typing import Any

from specshim._prefix_reuse import reusing_prefixes
from specshim._types import NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import adapt_kwargs, keyword_default


def _forced(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs["enable_prefix_caching"] = reusing_prefixes()
    return kwargs


def _probe(original: Any) -> None:
    if keyword_default(original, "enable_prefix_caching", required=True) in (
        False,
        None,
    ):
        raise NotNeeded("prefix caching is off by default")


PATCH = declare(
    __name__,
    __doc__,
    id="prefix-caching-off",
    attribute="CacheConfig",
    versions=">=0.12",
    probe=_probe,
    build=lambda original: adapt_kwargs(original, _forced),
    drift_rows=(3,),
)
