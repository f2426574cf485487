"""The CPU platform chooses the KV cache block size, where speculators' 16 does
not fit its attention kernels.

Why:
    speculators builds ``CacheConfig(block_size=16)``. vLLM 0.29's CPU
    attention backend only runs kernel block sizes that are multiples of 32,
    and a block size the user gave is kept as given, so every worker fails in
    ``initialize_kv_cache``: "No common block size for 16". When vLLM picks
    itself, its CPU platform chooses 128 (and 16 for its CPU MLA backend,
    whose kernels want 16). On the CPU platform, where the CPU attention
    backend does not accept speculators' size, speculators' ``CacheConfig``
    is built without ``block_size`` so that the platform chooses. The block
    size changes how the KV cache is paged, not what the model computes.
Upstream change:
    vLLM 0.29: ``CPUAttentionBackend.get_supported_kernel_block_sizes()`` is
    ``[MultipleOf(32)]`` (it was ``MultipleOf(16)``).
Upstream PR:
    not found.
Remove when:
    speculators leaves the block size to the platform, or vLLM's CPU
    attention runs 16-token blocks again.
"""

from __future__ import annotations

import importlib
from typing import Any

from specshim._types import NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import adapt_kwargs

_CPU_ATTENTION = "vllm.v1.attention.backends.cpu_attn"


def cpu_attention_accepts(block_size: int) -> bool | None:
    """Whether vLLM's CPU attention kernels run this block size (None: no backend)."""
    try:
        backend = importlib.import_module(_CPU_ATTENTION).CPUAttentionBackend
    except (ImportError, AttributeError):
        return None
    for size in backend.get_supported_kernel_block_sizes():
        base = getattr(size, "base", None)
        if (base is not None and block_size % base == 0) or size == block_size:
            return True
    return False


def require_platform_blocks() -> None:
    """Raise ``NotNeeded`` unless this is vLLM's CPU platform and its attention
    refuses speculators' 16-token blocks (so the platform chooses them)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise NotNeeded(f"platform is {current_platform.device_type!r}, not cpu")
    accepts = cpu_attention_accepts(16)
    if accepts is None:
        raise NotNeeded("no CPU attention backend to ask (its kernels took 16)")
    if accepts:
        raise NotNeeded("the CPU attention kernels run 16-token blocks")


def _probe(original: Any) -> None:
    require_platform_blocks()


def _platform_chooses(kwargs: dict[str, Any]) -> dict[str, Any]:
    size = kwargs.get("block_size")
    if size is not None and not cpu_attention_accepts(int(size)):
        del kwargs["block_size"]
    return kwargs


PATCH = declare(
    __name__,
    __doc__,
    id="cpu-block-size",
    attribute="CacheConfig",
    versions=">=0.29",
    probe=_probe,
    build=lambda original: adapt_kwargs(original, _platform_chooses),
    platform="cpu",
    drift_rows=(26,),
)
