"""Helpers shared by the main-process patch tests: applying a patch to a
fake, and a small stand-in for vLLM's config."""

from __future__ import annotations

from types import SimpleNamespace


def _applied(module, original):
    module.PATCH.probe(original)
    return module.PATCH.build(original)


def _vllm_config(block=16, dcp=1, pcp=1, caching=False):
    return SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=block,
            enable_prefix_caching=caching,
            prefix_caching_hash_algo="sha256",
        ),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp
        ),
    )
