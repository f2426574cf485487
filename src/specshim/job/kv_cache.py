"""vLLM's CPU KV-cache space for a job (``VLLM_CPU_KVCACHE_SPACE``): how much
the job needs, and the variable set for the generator's construction only."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from specshim.job.checkpoint import kv_bytes_per_token
from specshim.patches._util import scoped_environ

if TYPE_CHECKING:
    from specshim.job.options import ExtractOptions

VARIABLE = "VLLM_CPU_KVCACHE_SPACE"


def cpu_kv_space(
    options: ExtractOptions, max_batched_tokens: int, cache_memory_fraction: float
) -> tuple[int, str]:
    """vLLM's CPU KV-cache space for this job, in GiB, and where it came from.

    speculators gives its KV cache ``space * gpu_memory_utilization *
    cache_memory_fraction``; the job needs one step's tokens (at least one
    whole sequence), twice over for block rounding. The machine caps it at
    half of the memory available now. vLLM's own default is most of the
    machine's free memory.
    """
    if options.cpu_kv_space_gib is not None:
        return options.cpu_kv_space_gib, "--cpu-kv-space-gib"
    if os.environ.get(VARIABLE, "").strip():
        return int(os.environ[VARIABLE]), VARIABLE
    tokens = max(max_batched_tokens, options.max_model_len)
    need = 2 * tokens * kv_bytes_per_token(options.model)
    need /= options.gpu_memory_utilization * cache_memory_fraction
    gib = 1 << 30
    available = available_memory() // 2
    return max(1, min(-(-int(need) // gib), available // gib)), "the job's need"


def available_memory() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


@contextmanager
def cpu_kv_cache_space(gib: int | None) -> Iterator[None]:
    """``VLLM_CPU_KVCACHE_SPACE`` for the workers a generator starts inside the
    block (they read it as they start), restored afterwards; ``None`` leaves
    it as it is."""
    with scoped_environ({} if gib is None else {VARIABLE: str(gib)}):
        yield
