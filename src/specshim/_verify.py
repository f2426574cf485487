"""``specshim verify``: recompute written samples with Hugging Face transformers."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from specshim._extract import CONFIG_NAME
from specshim._registry import SpecShimError

_NAME = re.compile(r"^data_(\d+)\.pt$")


def agreement(
    model: Path, files: list[tuple[int, Path]], layers: list[int]
) -> tuple[dict[int, tuple[float, float]], list[str]]:
    """Per-layer (mean cosine, share of tokens >= 0.95) over ``files`` against an
    HF forward, and the files that fail the per-sample bar (``mismatch``)."""
    import torch

    from specshim.testing.reference import HFReference, mismatch, per_token_cosine

    reference = HFReference(str(model))
    per_layer: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    failures = []
    for index, path in files:
        data = torch.load(path, weights_only=True)
        ids = data["input_ids"].tolist()
        expected = reference.states(ids, layers)
        why = mismatch(data["hidden_states"], expected)
        if why:
            failures.append(f"data_{index}.pt: {why}")
        for layer, got, want in zip(
            layers, data["hidden_states"], expected, strict=False
        ):
            if got.shape == want.shape:
                per_layer[layer].append(per_token_cosine(got, want))
            else:
                per_layer[layer].append(torch.zeros(len(ids)))
    stats = {}
    for layer, parts in per_layer.items():
        cos = torch.cat(parts)
        stats[layer] = (cos.mean().item(), (cos >= 0.95).float().mean().item())
    return stats, failures


def written_files(out: Path) -> list[tuple[int, Path]]:
    """(i, path) of every ``data_{i}.pt`` in ``out``, by i."""
    return sorted(
        (int(m.group(1)), p) for p in out.iterdir() if (m := _NAME.match(p.name))
    )


def verify(model: Path, out: Path, samples: int, seed: int) -> int:
    """Print per-layer agreement for ``samples`` files; 1 if any disagrees."""
    config_file = out / CONFIG_NAME
    if not config_file.is_file():
        raise SpecShimError(
            f"{out}: no {CONFIG_NAME}; is this an extract output directory?"
        )
    layers = json.loads(config_file.read_text())["layers"]
    files = written_files(out)
    if not files:
        raise SpecShimError(f"{out}: no data_{{i}}.pt files to verify")
    chosen = sorted(random.Random(seed).sample(files, min(samples, len(files))))
    stats, failures = agreement(model, chosen, layers)
    print(
        f"verify: {len(chosen)} of {len(files)} samples in {out} against HF ({model})"
    )
    print("  layer   mean cosine   tokens >= 0.95")
    for layer, (mean, share) in stats.items():
        print(f"  {layer:>5}   {mean:>11.4f}   {share:>14.1%}")
    for failure in failures:
        print(f"  MISMATCH {failure}")
    print("verify: " + ("FAILED" if failures else "ok"))
    return 1 if failures else 0
