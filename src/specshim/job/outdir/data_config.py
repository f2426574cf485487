"""``data_config.json``: the settings a directory's samples were extracted
with. The first sample written publishes them; every later run must share the
ones that decide what the states are (``RUN_IDENTITY``), and ``verify`` and
``status`` read them back, checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specshim._base import PACKAGES, SpecShimError, UsageError
from specshim._versions import installed_version
from specshim.job.outdir.manifest import decode_json

CONFIG_NAME = "data_config.json"

# Keys of data_config.json that must agree before a run may add to a directory.
# The dataset is not among them: samples are identified by content.
RUN_IDENTITY = ("model_fingerprint", "layers", "max_model_len", "versions")
# Versions that change what the states are; others (torch, transformers) are
# recorded only.
PINNED_VERSIONS = ("vllm", "speculators")


def read_config(out: Path) -> dict[str, Any] | None:
    """``data_config.json`` of ``out``; None if there is none yet."""
    path = out / CONFIG_NAME
    if path.exists() and not path.is_file():  # a FIFO would block the read
        raise SpecShimError(f"{path} is not a regular file; it is not specshim's")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecShimError(f"{path}: cannot read it ({exc})") from None
    try:
        config = decode_json(text)
    except ValueError as exc:
        raise SpecShimError(
            f"{path} is corrupt ({exc}); it is not specshim's. Restore it, or use "
            "a new --out."
        ) from None
    if not isinstance(config, dict):
        raise SpecShimError(f"{path} is corrupt: not a JSON object")
    return config


def truncation_length(max_model_len: int) -> int:
    """The most tokens of a sample that are extracted: speculators' generator
    leaves room for one generated token within ``max_model_len``."""
    return max_model_len - 1


def run_identity(
    fingerprint: str, layers: list[int], max_model_len: int
) -> dict[str, Any]:
    """What a directory's samples depend on: the settings every run adding to it
    must share (``fingerprint``: the checkpoint's ``model_fingerprint``)."""
    return {
        "model_fingerprint": fingerprint,
        "layers": layers,
        "max_model_len": max_model_len,
        "versions": {n: installed_version(n) for n in PINNED_VERSIONS},
    }


def check_identity(
    out: Path, existing: dict[str, Any], identity: dict[str, Any]
) -> None:
    """Refuse to add to ``out`` if it holds output of other settings."""
    changed = [k for k in RUN_IDENTITY if existing.get(k) != identity[k]]
    if not changed:
        return
    if "model_fingerprint" not in existing:
        detail = "it was written by an older specshim that identified runs by path"
    else:
        detail = "; ".join(
            f"{k}: {existing.get(k)!r} there, {identity[k]!r} now" for k in changed
        )
    raise UsageError(
        f"{out} holds output of different settings ({detail}). Use another "
        "--out, or remove the directory to start over."
    )


def check_out(out: Path, identity: dict[str, Any]) -> None:
    """Refuse ``out`` if it holds output of other settings than ``identity``
    (nothing to check where it is no directory yet)."""
    if not out.is_dir():
        return
    existing = read_config(out)
    if existing is not None:
        check_identity(out, existing, identity)


def output_config(identity: dict[str, Any], model: Path, tp: int) -> dict[str, Any]:
    """``data_config.json`` as the first sample of a directory publishes it."""
    import specshim

    config = dict(identity)
    config.update(
        model=str(model.resolve()),
        tensor_parallel_size=tp,
        format="speculators-0.3.0 hidden states (data_{i}.pt per sample)",
        files="data_{i}.pt holds sample i of the dataset",
        hidden_states="one tensor per layer, in the order of 'layers'",
        recorded_versions={n: installed_version(n) for n in PACKAGES}
        | {"specshim": specshim.__version__},
    )
    return config


def run_config(out: Path) -> dict[str, Any]:
    """``data_config.json`` of an extract output directory, checked."""
    if not out.is_dir():
        raise UsageError(f"--out {out}: no such directory")
    config = read_config(out)
    if config is None:
        raise UsageError(
            f"{out}: no {CONFIG_NAME}; is this an extract output directory?"
        )
    layers = config.get("layers")
    if not isinstance(layers, list) or not all(_is_int(i) for i in layers):
        raise SpecShimError(f"{out / CONFIG_NAME} is corrupt: no list of layers")
    length = config.get("max_model_len")
    if not _is_int(length) or length < 2:
        raise SpecShimError(
            f"{out / CONFIG_NAME} is corrupt: max_model_len is {length!r}, not a "
            "whole number of at least 2"
        )
    tp = config.get("tensor_parallel_size", 1)
    if tp is not None and (not _is_int(tp) or tp < 1):
        raise SpecShimError(
            f"{out / CONFIG_NAME} is corrupt: tensor_parallel_size is {tp!r}"
        )
    return config


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
