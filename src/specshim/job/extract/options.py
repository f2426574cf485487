"""What ``specshim extract`` is asked to do: its options, with their defaults
(the command line reads them from here), and parsing of ``--layers``. Light on
purpose: the command line imports it to build its parser."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specshim._base import UsageError
from specshim._knobs import DEFAULT_BATCH_SIZE


@dataclass
class ExtractOptions:
    model: Path
    data: Path
    out: Path
    layers: list[int] | None = None
    max_model_len: int = 2048
    tp: int = 1
    batch_size: int = DEFAULT_BATCH_SIZE
    gpu_memory_utilization: float = 0.8
    shard: tuple[int, int] = (0, 1)
    split: str | None = None  # for datasets with splits (default: train)
    column: str | None = None  # the field holding the data (default: by name)
    progress: bool | None = None  # None: a bar on a terminal, log lines otherwise
    # Step budget and KV-cache fraction (specshim.configure); None: the
    # SPECSHIM_* variable if set, else STEP_DEFAULTS.
    max_num_seqs: int | None = None
    max_batched_tokens: int | None = None
    cache_memory_fraction: float | None = None
    # Files of samples the dataset no longer has: moved to .specshim/orphans/
    # if True, else the run ends with an error naming them.
    move_orphans: bool = False
    # vLLM's CPU KV-cache space in GiB, on a host without an accelerator;
    # None: VLLM_CPU_KVCACHE_SPACE if set, else what the job needs (cpu_kv_space).
    cpu_kv_space_gib: int | None = None
    # Shared prefixes computed once (issue 47): prefix caching on, the feed
    # in the plan's order, served rows put back from the rows of the sample
    # that computed them. The rows waiting for their next sample are held in
    # host memory: at most reuse_cap_mib MiB (None: what the plan needs).
    reuse_prefixes: bool = False
    reuse_cap_mib: int | None = None


def parse_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(
            f"--layers {text!r}: expected comma-separated integers"
        ) from None
