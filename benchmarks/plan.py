"""What ``make bench`` measures: paths, systems, models, layers, the sweep."""

from __future__ import annotations

import re
from pathlib import Path
from types import MappingProxyType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "benchmarks"
CACHE = HERE / ".cache"
PY = ROOT / ".venv" / "bin" / "python"
UV = ROOT / ".venv" / "bin" / "uv"
SPEC041_VENV = ROOT / ".venv-bench-spec041"
SPEC041_REQS = (HERE / "requirements-spec041.txt", ROOT / "requirements/overrides.txt")

SYSTEMS = ("specshim", "spec041", "hf")
# In the tables: specshim at speculators' own budget, then at the budget the
# sweep chose (its label is made from the chosen point: ``tuned_label``).
ALL_SYSTEMS = ("specshim", "specshim-tuned", "spec041", "hf")
LABELS = MappingProxyType(
    {
        "specshim": "specshim + speculators 0.3.0",
        "spec041": "speculators 0.4.0.1",
        "hf": "HF transformers (hooks, 1 seq)",
    }
)
MODELS = ("deepseek_v3", "llama")
MODEL_LABELS = MappingProxyType(
    {"deepseek_v3": "DeepSeek-V3 MoE (tiny)", "llama": "Llama (tiny)"}
)
LAYERS = (2, 4, 7)
BATCH = 32  # sequences per generate() call in the comparison

# The sweep: (max_num_seqs, max_batched_tokens, cache_memory_fraction,
# generate() batch size). The KV cache bounds how many tokens a step can hold
# (0.2 of 4 GiB: ~84k tokens of the tiny DeepSeek), so the largest steps need
# a larger fraction.
NOISE = 0.03  # sweep points this close to the fastest count as equally fast
DEFAULT_POINT = (32, 8192, 0.2, 32)  # speculators 0.3.0's constants
SWEEP = (
    DEFAULT_POINT,
    (32, 8192, 0.2, 128),
    (64, 16384, 0.2, 64),
    (128, 32768, 0.2, 128),
    (256, 65536, 0.2, 256),
    (256, 131072, 0.5, 256),
)

# Runner environment: vLLM's CPU KV-cache space (speculators sizes its cache
# as a fraction of it), no model hub, MLA off (no CPU kernel; specshim sets it
# anyway, spec041 needs it too).
RUN_ENV = MappingProxyType(
    {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_MLA_DISABLE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
)

NOTES = (
    "speculators 0.4.0.1 needs one change to run without a GPU: its "
    "generator's `mem_get_info()` returns (0, 0) when torch sees no "
    "accelerator (zero KV blocks). The benchmark makes it return vLLM's "
    "CPU KV-cache space, the number specshim gives 0.3.0; nothing else.",
    "speculators 0.4.0.1 returns each batch sorted by request-id string "
    "(`req_0_10` before `req_0_2`), so a batch of more than 10 comes back "
    "out of input order. Agreement above is computed after matching rows "
    "by their input ids; 'input order' says what a caller pairing results "
    "with inputs by position would get.",
    "HF runs the decoder stack only (no LM head), bfloat16, one sequence "
    "per forward; cosine is against an HF float32 forward of the same rows.",
    "cProfile share: specshim's own functions (tottime) over the wall time "
    "of one profiled generate(); cProfile slows what it watches, so this is "
    "an upper bound.",
)


def tuned_label(point: tuple[int, int, float, int]) -> str:
    """The label of specshim at the sweep's chosen point."""
    seqs, tokens, fraction, batch = point
    return (
        f"specshim + speculators 0.3.0, tuned ({seqs} seqs / "
        f"{tokens:,} tokens a step, KV {fraction}, {batch} per call)"
    )


# extract's closing line on where its time went (``command._counts``).
_TIMING = re.compile(
    r"of ([\d.]+) s after the first generate\(\): generate\(\) ([\d.]+) s, handing "
    r"batches to the writer ([\d.]+) s; the writer waited for batches ([\d.]+) s, "
    r"for its (\d+) threads' files ([\d.]+) s, and committed ([\d.]+) s"
)
TIMING_KEYS = (
    "total",
    "generate",
    "handing",
    "writer_idle",
    "threads",
    "writer_serializing",
    "writer_committing",
)


# Its line on the generate() calls: the first (warm-up), the median, the slowest.
_CALLS = re.compile(
    r"its \d+ generate\(\) calls took ([\d.]+) s \(the first\), ([\d.]+) s "
    r"\(the median\), ([\d.]+) s \(the slowest\)"
)
CALL_KEYS = ("generate_first", "generate_median", "generate_slowest")

# Its line on the run's end: the writer's backlog after the last call, and
# the time between calls.
_END = re.compile(
    r"after its last generate\(\) the writer took ([\d.]+) s to finish; "
    r"between calls \(the feed, the checks\) ([\d.]+) s"
)
END_KEYS = ("finishing", "between_calls")

# The manifest's fsyncs (the committer's group commit; older logs lack it).
_SYNCS = re.compile(r"and committed [\d.]+ s \((\d+) fsyncs of the manifest\)")
SYNC_KEYS = ("writer_syncs",)

# And how the states came: slabs mapped, GB through vLLM's queue.
_MOVED = re.compile(
    r"the states came through (\d+) shared slabs, and ([\d.]+) GB of them "
    r"through vLLM's queue"
)
MOVED_KEYS = ("slabs", "queued_gb")


def extract_timing(log: str) -> dict[str, Any] | None:
    """Where an ``extract`` run's time went, from its log; None without the
    line. With the calls' line, their first, median and slowest seconds;
    with the end's and the transport's lines, theirs."""
    found = _TIMING.search(log)
    if not found:
        return None
    timing = dict(zip(TIMING_KEYS, map(float, found.groups()), strict=True))
    for pattern, keys in (
        (_CALLS, CALL_KEYS),
        (_END, END_KEYS),
        (_MOVED, MOVED_KEYS),
        (_SYNCS, SYNC_KEYS),
    ):
        found = pattern.search(log)
        if found:
            timing |= dict(zip(keys, map(float, found.groups()), strict=True))
    return timing


def timing_sentence(label: str, timing: dict[str, Any]) -> str:
    """``extract_timing``'s figures as the notes say them."""
    return (
        f"of {label}'s {timing['total']} s, generate() took "
        f"{timing['generate']} s and handing batches to the writer "
        f"{timing['handing']} s; the writer waited "
        f"{timing['writer_serializing']} s for its {int(timing['threads'])} "
        f"threads' files, committed {timing['writer_committing']} s"
        + (
            f" in {int(timing['writer_syncs'])} fsyncs of the manifest"
            if "writer_syncs" in timing
            else ""
        )
        + f" and waited for batches {timing['writer_idle']} s"
        + (
            f"; a generate() call took {timing['generate_first']} s first, "
            f"{timing['generate_median']} s at the median and "
            f"{timing['generate_slowest']} s at the slowest"
            if "generate_first" in timing
            else ""
        )
        + (
            f"; after the last call the writer took {timing['finishing']} s "
            f"to finish, and the time between calls came to "
            f"{timing['between_calls']} s"
            if "finishing" in timing
            else ""
        )
        + (
            f"; the states came through {int(timing['slabs'])} shared slabs "
            f"and {timing['queued_gb']} GB through vLLM's queue"
            if "slabs" in timing
            else ""
        )
    )
