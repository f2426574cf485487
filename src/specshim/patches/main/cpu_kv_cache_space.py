"""KV-cache sizing without CUDA: use vLLM's CPU KV-cache space.

Why:
    speculators sizes its KV cache as ``torch.cuda.mem_get_info()[0] *
    gpu_memory_utilization * CACHE_MEMORY_FRACTION``. On a host with no CUDA
    device ``torch.cuda.mem_get_info()`` raises, so the generator cannot start
    on vLLM's CPU backend. On the CPU platform speculators' module sees a
    ``torch`` whose ``cuda.mem_get_info()`` reports vLLM's CPU KV-cache space
    (``VLLM_CPU_KVCACHE_SPACE`` GiB, or vLLM's own default) as free memory, so
    speculators' own fractions apply to the memory vLLM set aside for KV cache.
    Everything else in that ``torch`` is the real module. The variable is read
    here, as vLLM parses it: from vLLM 0.20 the platform's
    ``get_device_total_memory()`` is the machine's memory whatever it says,
    and only an engine vLLM builds itself applies the variable.
Upstream change:
    Not drift: speculators assumes a CUDA device. vLLM 0.20 moved the
    variable from ``CpuPlatform.get_device_total_memory`` to
    ``cache_config.kv_cache_memory_bytes``, which speculators never reads.
Upstream PR:
    not found for the 0.20 move.
Remove when:
    speculators sizes the KV cache through vLLM's platform API.
"""

from __future__ import annotations

from typing import Any

import wrapt

from specshim._types import NotNeeded
from specshim.patches._declare import declare


def _cpu_kv_cache_space() -> int:
    """Bytes: ``VLLM_CPU_KVCACHE_SPACE`` GiB if set, else the platform's figure
    (before vLLM 0.20 its default KV-cache space; from 0.20 the machine's
    memory, which speculators then scales by its fractions as on a GPU)."""
    from vllm import envs
    from vllm.platforms.cpu import CpuPlatform

    space = envs.VLLM_CPU_KVCACHE_SPACE
    if space:
        return int(space) << 30
    return int(CpuPlatform.get_device_total_memory())


class _CudaOnCpu(wrapt.ObjectProxy):  # type: ignore[misc]
    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        space = _cpu_kv_cache_space()
        return space, space

    def empty_cache(self) -> None:
        return None


class _TorchOnCpu(wrapt.ObjectProxy):  # type: ignore[misc]
    __specshim__ = True

    @property
    def cuda(self) -> Any:
        return _CudaOnCpu(self.__wrapped__.cuda)


def _probe(original: Any) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise NotNeeded(f"platform is {current_platform.device_type!r}, not cpu")


PATCH = declare(
    __name__,
    __doc__,
    id="cpu-kv-cache-space",
    attribute="torch",
    versions=">=0.11",
    probe=_probe,
    build=_TorchOnCpu,
    drift_rows=(9,),
    platform="cpu",
)
