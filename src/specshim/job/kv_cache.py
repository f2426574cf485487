"""vLLM's CPU KV-cache space for a job (``VLLM_CPU_KVCACHE_SPACE``): how much
the job needs, and the variable set for the generator's construction only."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from specshim._base import UsageError
from specshim._environ import scoped_environ

VARIABLE = "VLLM_CPU_KVCACHE_SPACE"
# Set by ``extract --data-parallel N`` in each of its N runs on a CPU host:
# they start at once, each sees the same free memory, so each may take only
# its share of the half a run may take.
SHARE = "SPECSHIM_CPU_KV_SHARE"


def kv_need(
    step_tokens: int,
    max_model_len: int,
    bytes_per_token: int,
    gpu_memory_utilization: float,
    cache_memory_fraction: float,
) -> float:
    """The CPU KV-cache space the job needs, in bytes.

    speculators gives its KV cache ``space * gpu_memory_utilization *
    cache_memory_fraction``; the job needs one step's tokens (at least one
    whole sequence), twice over for block rounding.
    """
    need = 2 * max(step_tokens, max_model_len) * bytes_per_token
    return need / (gpu_memory_utilization * cache_memory_fraction)


def cpu_kv_space(flag_gib: int | None, need: float | None) -> tuple[int, str]:
    """vLLM's CPU KV-cache space for this job, in GiB, and where it came from:
    ``--cpu-kv-space-gib``, else the variable, else the job's ``need`` (bytes,
    ``kv_need``) capped at half of the memory available now, divided among
    the runs of one ``--data-parallel`` command. vLLM's own default is most of
    the machine's free memory."""
    if flag_gib is not None:
        return flag_gib, "--cpu-kv-space-gib"
    if os.environ.get(VARIABLE, "").strip():
        return int(os.environ[VARIABLE]), VARIABLE
    if need is None:
        raise UsageError(
            "--model: its config.json does not say how large a token's KV cache "
            "is (layers, heads, head size); give --cpu-kv-space-gib"
        )
    gib = 1 << 30
    share = _share()
    available = available_memory() // 2 // share
    source = "the job's need"
    if share > 1:
        source += f", at most half the available memory over {share} runs"
    return max(1, min(-(-int(need) // gib), available // gib)), source


def _share() -> int:
    """How many runs share this host's memory (``SPECSHIM_CPU_KV_SHARE``)."""
    value = os.environ.get(SHARE, "").strip() or "1"
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"{SHARE}={value}: give the number of runs, 1 or more")
    return int(value)


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
