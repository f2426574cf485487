"""``specshim export``: an extract's output in the layout today's speculators
trains from (``--to speculators``; read from speculators 0.9.0's own
``speculators.train.data.ArrowDataset``, see docs/notes/export-layouts.md).

DEST holds a ``datasets.save_to_disk`` dataset (``input_ids``, ``loss_mask``,
``seq_len``; torch format) whose row i is sample i, and
``hidden_states/hs_{i}.safetensors`` with ``token_ids`` and ``hidden_states``
``[seq, layers, hidden]``. speculators 0.3.0's layer id k is the *output* of
decoder layer k; from 0.5 an id names the state *entering* that layer, so k
becomes k + 1, and the last slot is taken as the verifier's last hidden state
(pre-norm: the trainer applies the final norm). The export therefore needs
the final decoder layer among the captured ones, and training needs
``--target-layer-ids`` = the mapped ids of the others, which
``specshim_export.json`` records.

Every sample is checked before it is written (the source file holds the
tokens its manifest entry records, and one state of the model's width per
captured layer) and after: the file read back holds the source's token ids
and, bit for bit, its states in the chosen dtype. A rerun resumes: a file
the export's own manifest describes (source and destination unchanged) is
kept. ``specshim_export.json`` is written last: without it the export is not
whole.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specshim._base import SpecShimError, UsageError
from specshim.job.export.dest import ExportManifest, read_marker
from specshim.job.outdir.data_config import run_config
from specshim.job.outdir.store import Entry, file_identity, final_path

logger = logging.getLogger(__name__)

FORMAT = "speculators>=0.5 (ArrowDataset + hidden_states/hs_{i}.safetensors)"
TESTED_WITH = "speculators 0.9.0"
MARKER = "specshim_export.json"
_META = ".specshim-export"
DTYPES = ("source", "bfloat16", "float32", "fp8")
# fp8: float8 e4m3 with one float32 scale per token over all its layers, the
# payload speculators' ``fp8`` hidden-states backend dequantizes on reading
# (``hs_connectors``: ``hidden_states_scales``, ``fp8 * scale``).
FP8_SCALES = "hidden_states_scales"


@dataclass
class ExportOptions:
    out: Path  # the extract output (speculators 0.3.0 layout)
    dest: Path
    to: str = "speculators"
    model: Path | None = None  # default: the model data_config.json names
    dtype: str = "source"


def layer_mapping(layers: list[int], num_layers: int) -> dict[str, Any]:
    """speculators 0.3.0's captured ids in the newer convention, checked."""
    if len(layers) < 2:
        raise UsageError(
            f"the extract captured layers {layers}: the newer trainers need at "
            "least one auxiliary layer besides the final one"
        )
    if layers[-1] != num_layers - 1:
        raise UsageError(
            f"the extract's last captured layer is {layers[-1]}, not the model's "
            f"final decoder layer {num_layers - 1}: speculators >= 0.5 takes the "
            "last slot as the verifier's last hidden state. Re-extract with "
            f"--layers ending in {num_layers - 1}"
        )
    mapped = [k + 1 for k in layers]
    return {
        "source_layers": layers,
        "source_convention": "speculators 0.3.0: id k = output of decoder layer k",
        "layer_ids": mapped,
        "convention": "vLLM / speculators >= 0.5: id k = state entering layer k",
        "target_layer_ids": mapped[:-1],
        "verifier_last_slot": mapped[-1],
        "final_norm": "not applied (the trainer applies the verifier's norm)",
    }


def stacked(states: list[Any], dtype: str) -> Any:
    """The per-layer states of one sample as ``[seq, layers, hidden]``."""
    import torch

    stack = torch.stack(states, dim=1)
    return stack if dtype in ("source", "fp8") else stack.to(getattr(torch, dtype))


def encoded(stack: Any, dtype: str) -> dict[str, Any]:
    """What the file stores of ``stack``: the states, and for fp8 the scales."""
    import torch

    if dtype != "fp8":
        return {"hidden_states": stack.contiguous()}
    fp8 = torch.float8_e4m3fn
    peak = stack.float().abs().amax(dim=(1, 2), keepdim=True)
    scales = (peak / torch.finfo(fp8).max).clamp(min=1e-12)
    return {
        "hidden_states": (stack.float() / scales).to(fp8).contiguous(),
        FP8_SCALES: scales.contiguous(),
    }


def decoded(stored: dict[str, Any]) -> Any:
    """The states a reader gets back from ``encoded``'s output, in float32."""
    states = stored["hidden_states"].float()
    return states * stored[FP8_SCALES] if FP8_SCALES in stored else states


def _agreement(source: Any, stored: dict[str, Any]) -> list[list[float]]:
    """Per layer: mean and lowest per-token cosine, mean norm ratio of what a
    reader gets back against the source."""
    from specshim.job.verify.hf_reference import norm_ratio, per_token_cosine

    back = decoded(stored)
    rows = []
    for k in range(source.shape[1]):
        cos = per_token_cosine(back[:, k], source[:, k])
        ratio = norm_ratio(back[:, k], source[:, k])
        rows.append([cos.mean().item(), cos.min().item(), ratio.mean().item()])
    return rows


def _same(a: Any, b: Any) -> bool:
    """Bit-equal tensors of one dtype (float8 compared as bytes)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float8_e4m3fn:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def export(options: ExportOptions) -> dict[str, Any]:
    """Write or finish the export; returns counts. Raises UsageError on a
    source it cannot vouch for, SpecShimError where a written file disagrees."""
    if options.to != "speculators":
        raise UsageError(f"--to {options.to!r}: the known layout is 'speculators'")
    if options.dtype not in DTYPES:
        raise UsageError(f"--dtype {options.dtype!r}: choose one of {DTYPES}")
    config = run_config(options.out)
    model = _model(options, config)
    from specshim.job.inputs.checkpoint import hidden_size, model_facts

    mapping = layer_mapping(list(config["layers"]), model_facts(model)[0])
    total, proven = _complete_source(options.out)
    source = _Source(proven, list(config["layers"]), hidden_size(model))
    marker = _prepare_dest(options, mapping, total)
    written = kept = 0
    path = options.dest / _META / "manifest.jsonl"
    manifest = ExportManifest(path, len(mapping["layer_ids"]))
    for index in range(total):
        if manifest.holds(index, options.out, options.dest):
            kept += 1
            continue
        manifest.add(index, options.dest, _write_one(options, index, source))
        written += 1
    manifest.close()
    _remove_stale(options.dest, total)
    _write_arrow(options, total)
    result = _marker(config, mapping, total, options)
    result["agreement"] = manifest.agreement(total)
    marker.write_text(json.dumps(result, indent=2) + "\n")
    return {
        "samples": total,
        "written": written,
        "kept": kept,
        "agreement": result["agreement"],
        "train_with": result["train_with"],
        **mapping,
    }


def _model(options: ExportOptions, config: dict[str, Any]) -> Path:
    """The checkpoint the extract ran, proven by its fingerprint: its layer
    count decides the mapping."""
    from specshim.job.inputs.checkpoint import model_fingerprint

    model = options.model or Path(str(config.get("model", "")))
    if not (model / "config.json").is_file():
        raise UsageError(
            f"the model {model} named in {options.out}/data_config.json is not "
            "here; give its directory with --model"
        )
    if model_fingerprint(model) != config.get("model_fingerprint"):
        raise UsageError(
            f"{model} is not the checkpoint {options.out} was extracted with (its "
            "config, tokenizer or weight files differ from the fingerprint in "
            "data_config.json); give that checkpoint with --model"
        )
    return model


def _complete_source(out: Path) -> tuple[int, dict[int, Entry]]:
    """The dataset's size, where every sample of it is proven in ``out``, and
    the manifest entry that proves each."""
    from specshim.job.status import collect

    status = collect(out)
    if not status.complete or status.total is None:
        what = (
            "no finished extract run recorded the dataset's size"
            if status.total is None
            else f"{len(status.missing)} missing, {len(status.unproven)} unproven, "
            f"{len(status.orphans)} of no sample"
        )
        raise UsageError(
            f"{out} is not a complete extract ({what}); the trainer reads row i "
            "as sample i, so every sample is needed. Rerun the extract to finish "
            "it (`specshim status --out` shows what is left)"
        )
    return status.total, status.proven


@dataclass(frozen=True)
class _Source:
    """What each file of the extract must hold: the tokens its manifest entry
    records, and one [tokens, hidden] state per captured layer. The manifest
    proves a file by its size, inode and times; only reading it finds damage
    that kept those (bit rot, an edit that restored the times)."""

    proven: dict[int, Entry]
    layers: list[int]
    width: int

    def load(self, path: Path, index: int) -> dict[str, Any]:
        """Sample ``index`` from ``path``, checked; SpecShimError if it is not."""
        from specshim.job.outdir.store import token_digest
        from specshim.job.verify.command import load_sample, states_problem

        data, why = load_sample(path)
        if data is not None:
            ids, mask = data["input_ids"].long(), data["loss_mask"].long()
            states = data["hidden_states"]
            if token_digest(ids.tolist(), mask.tolist()) != self.proven[index].tokens:
                why = "holds other tokens than its manifest entry records"
            else:
                why = states_problem(states, self.layers, len(ids), self.width) or ""
        if why:
            raise SpecShimError(
                f"{path} {why}. Its manifest entry still vouches for it, so a "
                "rerun of extract would keep it: delete it, rerun the extract to "
                "write it again, then export (`specshim verify --all` finds any "
                "others)"
            )
        return data


def _prepare_dest(options: ExportOptions, mapping: dict[str, Any], total: int) -> Path:
    dest = options.dest
    if dest.resolve() == options.out.resolve():
        raise UsageError("--to DEST must be another directory than --out")
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"{dest} is a file; export to a directory")
    marker = dest / MARKER
    if marker.exists():
        before = read_marker(marker)
        if before.get("layer_mapping") != mapping or before.get("dtype") != (
            options.dtype
        ):
            raise UsageError(
                f"{dest} holds an export of other settings; use another "
                "directory or remove it"
            )
        marker.unlink()  # the export is whole again only once it is rewritten
    elif dest.exists() and any(dest.iterdir()) and not (dest / _META).is_dir():
        raise UsageError(f"{dest} exists and is not a specshim export; pick a new one")
    for folder in (dest / "hidden_states", dest / _META):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".specshim-write-test-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as exc:
            what = "is a file" if folder.is_file() else exc.strerror or str(exc)
            raise UsageError(
                f"cannot export into {folder}: {what}; pick a DEST this user "
                "can write, or remove what is in the way"
            ) from None
    return marker


def _write_one(
    options: ExportOptions, index: int, expected: _Source
) -> tuple[list[int], Any]:
    """Write ``hs_{index}.safetensors``, read it back, compare; returns the
    source's file identity as the manifest records it, and for fp8 what a
    reader gets back against the source, per layer."""
    import torch
    from safetensors.torch import load_file, save_file

    source = final_path(options.out, index)
    identity = list(file_identity(source.stat()))
    data = expected.load(source, index)
    ids = data["input_ids"].to(torch.int64).contiguous()
    stack = stacked(data["hidden_states"], options.dtype)
    payload = {"token_ids": ids, **encoded(stack, options.dtype)}
    target = options.dest / "hidden_states" / f"hs_{index}.safetensors"
    tmp = target.with_name(f".{target.name}.partial")
    save_file(payload, str(tmp))
    back = load_file(str(tmp))
    if set(back) != set(payload) or not all(_same(back[k], payload[k]) for k in back):
        tmp.unlink()
        raise SpecShimError(f"hs_{index}.safetensors read back differs from {source}")
    os.replace(tmp, target)
    agreement = _agreement(stack.float(), back) if options.dtype == "fp8" else None
    return identity, agreement


def _remove_stale(dest: Path, total: int) -> None:
    """Files of samples the source no longer has (an earlier export of a longer
    extract) and partial files of a killed run: no row of the table is theirs."""
    for path in (dest / "hidden_states").iterdir():
        name = path.name
        if name.startswith(".hs_") and name.endswith(".partial"):
            path.unlink()
        elif name.startswith("hs_") and name.endswith(".safetensors"):
            index = name[len("hs_") : -len(".safetensors")]
            if index.isdigit() and int(index) >= total:
                path.unlink()


def _write_arrow(options: ExportOptions, total: int) -> None:
    """The token table, row i = sample i, in torch format (as the trainer's
    own ``prepare-data`` saves it), replacing any earlier one."""
    import torch
    from datasets import Dataset, Features, Sequence, Value

    def rows() -> Any:
        for index in range(total):
            data = torch.load(
                final_path(options.out, index), weights_only=True, mmap=True
            )
            ids = data["input_ids"].to(torch.int64).tolist()
            mask = data["loss_mask"].to(torch.int64).tolist()
            yield {"input_ids": ids, "loss_mask": mask, "seq_len": len(ids)}

    features = Features(
        {
            "input_ids": Sequence(Value("int64")),
            "loss_mask": Sequence(Value("int64")),
            "seq_len": Value("int64"),
        }
    )
    cache = options.dest / _META / "cache"
    table = Dataset.from_generator(rows, features=features, cache_dir=str(cache))
    table.set_format(type="torch")
    staging = options.dest / _META / "arrow"
    shutil.rmtree(staging, ignore_errors=True)
    table.save_to_disk(str(staging))
    for old in options.dest.glob("data-*.arrow"):
        old.unlink()
    for item in staging.iterdir():
        os.replace(item, options.dest / item.name)
    shutil.rmtree(cache, ignore_errors=True)


def _marker(
    config: dict[str, Any], mapping: dict[str, Any], total: int, options: ExportOptions
) -> dict[str, Any]:
    import specshim

    ids = ",".join(map(str, mapping["target_layer_ids"]))
    return {
        "format": FORMAT,
        "tested_with": TESTED_WITH,
        "samples": total,
        "dtype": options.dtype,
        "layer_mapping": mapping,
        "train_with": f"--data-path {options.dest} --target-layer-ids {ids}"
        + (" --hidden-states-backend fp8" if options.dtype == "fp8" else ""),
        "source": str(options.out.resolve()),
        "source_model_fingerprint": config.get("model_fingerprint"),
        "max_model_len": config["max_model_len"],
        "specshim": specshim.__version__,
    }
