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
MEAN_COSINE = 0.98


def default_cache() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "specshim"


def ensure_model(cache: Path) -> Path:
    from specshim.testing.tiny_models import build_deepseek_v3

    path = cache / "tiny-deepseek-v3"
    if not (path / "model.safetensors").exists():
        tmp = path.with_name(path.name + ".tmp")
        build_deepseek_v3(tmp)
        tmp.rename(path)
    return path


def run(cache: Path | None = None) -> int:
    import specshim

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = ensure_model(cache or default_cache())
    from speculators.data_generation import VllmHiddenStatesGenerator
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    batch = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}],
            tokenize=True,
            add_generation_prompt=True,
        )
        for p in PROMPTS
    ]
    started = time.perf_counter()
    generator = VllmHiddenStatesGenerator(
        str(model), layer_ids=LAYERS, max_model_len=512
    )
    built = time.perf_counter() - started
    try:
        started = time.perf_counter()
        results = generator.generate(batch)
        elapsed = time.perf_counter() - started
    finally:
        generator.executor.shutdown()
    agreement = _agreement(str(model), batch, results)
    tokens = sum(map(len, batch))
    _print_summary(specshim.report(), built, tokens, elapsed, agreement)
    return 0 if all(mean >= MEAN_COSINE for mean, _ in agreement.values()) else 1


def _agreement(model: str, batch: list[list[int]], results: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    import torch

    from specshim.testing.reference import HFReference, per_token_cosine

    reference = HFReference(model)
    per_layer: dict[int, list[Any]] = {layer: [] for layer in LAYERS}
    for ids, result in zip(batch, results, strict=True):
        expected = reference.states(ids, LAYERS)
        for layer, got, want in zip(LAYERS, result["hidden_states"], expected, strict=True):
            if got.shape != want.shape:
                per_layer[layer].append(torch.zeros(len(ids)))
            else:
                per_layer[layer].append(per_token_cosine(got, want))
    out = {}
    for layer, parts in per_layer.items():
        cos = torch.cat(parts)
        out[layer] = (cos.mean().item(), (cos >= 0.95).float().mean().item())
    return out


def _print_summary(report: dict[str, Any], built: float, tokens: int, elapsed: float,
                   agreement: dict[int, tuple[float, float]]) -> None:
    applied = [p["id"] for p in report["patches"] if p["state"] == "applied"]
    lines = [
        "",
        "specshim demo: speculators 0.3.0 on vLLM "
        f"{report['versions']['vllm']} (CPU), tiny DeepSeek-V3 MoE",
        f"  patches applied here: {len(applied)} ({', '.join(applied)})",
        "  (worker patches apply inside vLLM's worker processes)",
        f"  generator start-up:   {built:.1f} s",
        f"  prefill:              {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:,.0f} tok/s",
        "",
        "  layer   mean cosine vs HF   tokens >= 0.95   verdict",
    ]
    for layer, (mean, share) in agreement.items():
        verdict = "ok" if mean >= MEAN_COSINE else "MISMATCH"
        lines.append(f"  {layer:>5}   {mean:>17.4f}   {share:>14.1%}   {verdict}")
    print("\n".join(lines), file=sys.stdout, flush=True)
