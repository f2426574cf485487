"""``specshim demo``: the whole path on a tiny model the tool builds itself.

Builds (once, cached) a tiny random-weight DeepSeek-V3-style MoE checkpoint and
tokenizer, runs speculators' unmodified ``VllmHiddenStatesGenerator`` on vLLM's
CPU backend over a few built-in chat prompts, checks every captured layer of
every sequence against a Hugging Face forward, and prints what happened.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

PROMPTS = [
    "Explain speculative decoding in one sentence.",
    "Write a haiku about tensor parallelism.",
    "Explain speculative decoding in one sentence.",  # a duplicate prompt
    "What is a KV cache?",
    "List three prime numbers.",
    "Why do draft models need hidden states?",
]
SYSTEM = "You are a concise assistant. Answer in plain words. " * 3  # shared prefix
LAYERS = [1, 3, 5]


def default_cache() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "specshim"


def ensure_model(cache: Path) -> Path:
    from specshim.job.inputs.tiny_checkpoints import build_deepseek_v3

    path = cache / "tiny-deepseek-v3"
    if not (path / "model.safetensors").exists():
        tmp = path.with_name(path.name + ".tmp")
        build_deepseek_v3(tmp)
        tmp.rename(path)
    return path


def run(cache: Path | None = None) -> int:
    import json
    import shutil

    import specshim
    from specshim.job.extract.command import ExtractOptions, extract
    from specshim.job.verify.command import hf_agreement, written_files

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cache = cache or default_cache()
    model = ensure_model(cache)
    data = cache / "demo-prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": p},
                        {"role": "assistant", "content": "Noted."},
                    ]
                }
            )
            + "\n"
            for p in PROMPTS
        )
    )
    out = cache / "demo-output"
    shutil.rmtree(out, ignore_errors=True)  # the demo always runs the whole job
    started = time.perf_counter()
    counts = extract(
        ExtractOptions(
            model=model,
            data=data,
            out=out,
            layers=LAYERS,
            max_model_len=512,
            batch_size=len(PROMPTS),
        )
    )
    total = time.perf_counter() - started
    stats, failures = hf_agreement(model, written_files(out), LAYERS)
    _print_summary(specshim.report(), total, counts, stats, failures, out)
    return 1 if failures else 0


def _print_summary(
    report: dict[str, Any],
    total: float,
    counts: dict[str, Any],
    stats: dict[int, tuple[float, float, float]],
    failures: list[str],
    out: Path,
) -> None:
    from specshim.job.verify.hf_reference import MEAN_COSINE, MEAN_NORM

    applied = [p["id"] for p in report["patches"] if p["state"] == "applied"]
    rate = counts["tokens"] / counts["seconds"] if counts["seconds"] else 0.0
    lines = [
        "",
        "specshim demo: speculators 0.3.0 on vLLM "
        f"{report['versions']['vllm']} (CPU backend), tiny DeepSeek-V3 MoE",
        f"  patches applied in this process: {len(applied)} of {len(report['patches'])}"
        " (worker patches apply inside each vLLM worker)",
        f"  samples written:  {counts['written']} to {out}",
        f"  extraction:       {counts['tokens']} tokens at {rate:,.0f} tok/s"
        f" ({total:.1f} s including model start-up)",
        "",
        "  layer   mean cosine vs HF   tokens >= 0.95   norm ratio   verdict",
    ]
    for layer, (mean, share, ratio) in stats.items():
        good = mean >= MEAN_COSINE and abs(ratio - 1) <= MEAN_NORM
        verdict = "ok" if good else "MISMATCH"
        row = f"  {layer:>5}   {mean:>17.4f}   {share:>14.1%}   {ratio:>10.3f}"
        lines.append(f"{row}   {verdict}")
    lines += [f"  {failure}" for failure in failures]  # BAD or MISMATCH
    lines.append("  every sample agrees with HF" if not failures else "  demo FAILED")
    print("\n".join(lines), file=sys.stdout, flush=True)
