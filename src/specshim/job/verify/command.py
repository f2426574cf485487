"""``specshim verify``: check written samples.

By default a few samples are recomputed, with a bounded Hugging Face forward
or alone through the run's own generator (``specshim.job.verify.modes``), and
compared per token and per layer; ``--all`` loads every file and checks it
against the dataset and the run's settings.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from specshim._base import SpecShimError
from specshim.job.outdir.data_config import run_config
from specshim.job.outdir.store import existing_files, final_path, foreign_files


def _model_input(path: Path, vocab_size: int) -> tuple[dict[str, Any] | None, str]:
    """``load_sample``, and ids the model can take: within its vocabulary (an
    embedding fails on others with an IndexError)."""
    data, why = load_sample(path)
    if data is not None:
        ids = data["input_ids"]
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            return (
                None,
                f"holds token ids outside the model's vocabulary [0, {vocab_size})",
            )
    return data, why


def agreement(
    reference: Any, files: list[tuple[int, Path]], layers: list[int], vocab_size: int
) -> tuple[dict[int, tuple[float, float, float]], list[str]]:
    """Per-layer (mean cosine, share of tokens >= 0.95, mean norm ratio) over
    ``files`` against ``reference.states(ids, layers)``, and a line for each
    file that fails: ``BAD`` if it holds no sample the model can take,
    ``MISMATCH`` if it fails the per-sample bar (direction and length)."""
    import torch

    from specshim.job.verify.hf_reference import mismatch, norm_ratio, per_token_cosine

    per_layer: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    ratios: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    failures = []
    for index, path in files:
        data, why = _model_input(path, vocab_size)
        if data is None:
            failures.append(f"BAD data_{index}.pt: {why}")
            continue
        ids = data["input_ids"].tolist()
        expected = reference.states(ids, layers)
        why = mismatch(data["hidden_states"], expected)
        if why:
            failures.append(f"MISMATCH data_{index}.pt: {why}")
        for layer, got, want in zip(
            layers, data["hidden_states"], expected, strict=False
        ):
            if got.shape == want.shape:
                per_layer[layer].append(per_token_cosine(got, want))
                ratios[layer].append(norm_ratio(got, want))
            else:
                per_layer[layer].append(torch.zeros(len(ids)))
                ratios[layer].append(torch.zeros(len(ids)))
    stats = {}
    for layer, parts in per_layer.items():
        cos = torch.cat(parts) if parts else torch.zeros(1)
        ratio = torch.cat(ratios[layer]) if ratios[layer] else torch.zeros(1)
        stats[layer] = (
            cos.mean().item(),
            (cos >= 0.95).float().mean().item(),
            ratio.mean().item(),
        )
    return stats, failures


def hf_agreement(
    model: Path, files: list[tuple[int, Path]], layers: list[int]
) -> tuple[dict[int, tuple[float, float, float]], list[str]]:
    """``agreement`` against the bounded HF reference (what ``demo`` uses)."""
    from specshim.job.inputs.checkpoint import model_facts
    from specshim.job.verify.modes import HFBounded

    vocab_size = model_facts(model)[1]
    return agreement(HFBounded(model, layers), files, layers, vocab_size)


def written_files(out: Path) -> list[tuple[int, Path]]:
    """(i, path) of every ``data_{i}.pt`` in ``out``, by i."""
    return [(i, final_path(out, i)) for i in sorted(existing_files(out))]


def _load(path: Path) -> Any:
    """A sample file, read without unpickling arbitrary objects."""
    import pickle
    import struct
    import warnings

    import torch

    # Bytes that are not a torch file reach the unpickler as opcodes: besides
    # its own errors it raises KeyError, IndexError or struct.error on them,
    # and warns about the "protocol" it thinks it read.
    unreadable = (pickle.UnpicklingError, RuntimeError, EOFError, OSError)
    unreadable += (ValueError, KeyError, IndexError, struct.error)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, weights_only=True)
    except unreadable as exc:
        text = str(exc).strip()
        first = text.splitlines()[0].split(". ")[0] if text else ""
        if isinstance(exc, (KeyError, IndexError, struct.error)) or not first:
            kind = "struct.error" if isinstance(exc, struct.error) else ""
            kind = kind or type(exc).__name__
            first = f"a damaged pickle: {kind} {first}".strip()
        raise UnreadableError(first) from None


class UnreadableError(Exception):
    pass


# How every file torch.save writes begins: a zip archive, or (the legacy
# format) a pickle of protocol 2 or later.
TORCH_HEADS = (b"PK\x03\x04", b"\x80")


def _not_torch(path: Path) -> str | None:
    """Why ``path`` cannot be a torch file from its first bytes, or None."""
    with path.open("rb") as handle:
        head = handle.read(16)
    if not head:
        return "is empty"
    if not head.startswith(TORCH_HEADS):
        return (
            f"is not a torch file (it begins {head[:8]!r}; torch writes a zip "
            "archive or a binary pickle)"
        )
    return None


def load_sample(path: Path) -> tuple[dict[str, Any] | None, str]:
    """The speculators sample in ``path``, or None and why it is not one."""
    import torch

    if not path.is_file():  # a FIFO would block the load, a folder fails it
        return None, "is not a regular file"
    why = _not_torch(path)
    if why:
        return None, why
    try:
        data = _load(path)
    except UnreadableError as exc:
        return None, f"cannot be loaded safely ({exc})"
    keys = {"input_ids", "hidden_states", "loss_mask"}
    if not isinstance(data, dict) or not keys <= set(data):
        return None, "is not a speculators sample (input_ids, hidden_states, loss_mask)"
    tensors = [data["input_ids"], data["loss_mask"]]
    states = data["hidden_states"]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in tensors):
        return None, "holds input_ids or loss_mask that are not 1-D tensors"
    ids = data["input_ids"]
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        return None, "holds input_ids that are not token ids (integers)"
    if not len(ids):
        return None, "holds no tokens"
    if not isinstance(states, list) or not all(
        isinstance(t, torch.Tensor) for t in states
    ):
        return None, "holds hidden_states that are not a list of tensors"
    return data, ""


def check_file(
    path: Path, sample: Any, layers: list[int], hidden_size: int
) -> str | None:
    """None if ``path`` holds ``sample`` in the run's shapes, else what is wrong."""
    import torch

    data, why = load_sample(path)
    if data is None:
        return why
    # Compared as values: cast to the file's dtype (uint8, say), the
    # dataset's ids would overflow or wrap.
    ids, mask = data["input_ids"], data["loss_mask"]
    if not torch.equal(ids.long(), torch.tensor(sample.input_ids, dtype=torch.long)):
        return "holds other input_ids than the dataset's sample"
    want = torch.tensor(sample.loss_mask, dtype=torch.float64)
    if not torch.equal(mask.to(torch.float64), want):
        return "holds another loss_mask than the dataset's sample"
    return states_problem(data["hidden_states"], layers, len(ids), hidden_size)


def states_problem(
    states: list[Any], layers: list[int], length: int, hidden_size: int
) -> str | None:
    """None if ``states`` are one finite [length, hidden_size] tensor per
    layer, else what is wrong."""
    import torch

    if len(states) != len(layers):
        return f"has {len(states)} hidden-state tensors for {len(layers)} layers"
    want = (length, hidden_size)
    for layer, tensor in zip(layers, states, strict=True):
        if tuple(tensor.shape) != want:
            return f"layer {layer}: shape {tuple(tensor.shape)}, expected {want}"
        if not bool(torch.isfinite(tensor).all()):
            return f"layer {layer}: holds NaN or infinite values"
    return None


def verify_all(
    model: Path,
    out: Path,
    data: Path,
    split: str | None = None,
    column: str | None = None,
) -> tuple[int, list[str]]:
    """Load every file of ``out`` and check it against ``data`` and the settings."""
    from specshim._settings import trust_remote_code
    from specshim.job.inputs.checkpoint import hidden_size, model_facts
    from specshim.job.inputs.dataset import RecordStream
    from specshim.job.inputs.tokenizing import Tokenizing, warn_truncated
    from specshim.job.outdir.data_config import truncation_length

    config = run_config(out)
    layers = config["layers"]
    _, vocab_size = model_facts(model)
    width = hidden_size(model)
    stream = RecordStream(data, split=split, column=column)
    tokenizing = Tokenizing(model, trust_remote_code())
    max_len = truncation_length(config["max_model_len"])
    files = dict(written_files(out))
    lines, bad, count = [], 0, 0  # bad: samples missing or wrong
    for record in stream:
        sample = tokenizing.sample(record, vocab_size, max_len)
        count += 1
        path = files.pop(sample.index, None)
        if path is None:
            lines.append(f"  MISSING data_{sample.index}.pt")
            bad += 1
            continue
        why = check_file(path, sample, layers, width)
        if why:
            lines.append(f"  BAD {path.name}: {why}")
            bad += 1
    for index, path in sorted(files.items()):  # what is left: no sample's file
        lines.append(f"  ORPHAN {path.name}: the dataset has no sample {index}")
    foreign = foreign_files(out)
    for name in foreign:
        lines.append(
            f"  FOREIGN {name}: speculators' trainer would read it (its name ends "
            "in pt) and it is no sample's file"
        )
    warn_truncated(tokenizing.truncated, count, max_len)
    head = f"verify --all: {stream.total} samples in {data}, {count - bad} good"
    head += f", {bad} bad or missing" if bad else ""
    head += f", {len(files)} file(s) of no sample" if files else ""
    head += f", {len(foreign)} foreign file(s)" if foreign else ""
    lines.insert(0, head)
    return _close(lines, bool(bad or files or foreign))


def verify(
    model: Path,
    out: Path,
    samples: int,
    seed: int,
    reference: str = "auto",
    tp: int | None = None,
) -> tuple[int, list[str]]:
    """Per-layer agreement for ``samples`` files, as lines; 1 if any disagrees."""
    from specshim.job.inputs.checkpoint import model_facts
    from specshim.job.verify import modes as _references

    config = run_config(out)
    layers = config["layers"]
    files = written_files(out)
    if not files:
        raise SpecShimError(f"{out}: no data_{{i}}.pt files to verify")
    mode, why = _references.choose(reference, model, layers)
    chosen = sorted(random.Random(seed).sample(files, min(samples, len(files))))
    lines = [f"verify: reference {mode} ({why})"]
    tp = int(tp or config.get("tensor_parallel_size") or 1)
    if mode == "hf":
        recompute: Any = _references.HFBounded(model, layers)
        what = f"a Hugging Face forward of {model}, layers 0..{max(layers)}"
    else:
        recompute = _references.Solo(model, layers, config["max_model_len"], tp)
        what = f"the generator alone, one sample a call (TP={tp})"
    try:
        stats, failures = agreement(recompute, chosen, layers, model_facts(model)[1])
    finally:
        recompute.close()
    lines.append(
        f"verify: {len(chosen)} of {len(files)} samples in {out} against {what}"
    )
    lines.append("  layer   mean cosine   tokens >= 0.95   norm ratio")
    for layer, (mean, share, ratio) in stats.items():
        lines.append(f"  {layer:>5}   {mean:>11.4f}   {share:>14.1%}   {ratio:>10.3f}")
    lines += [f"  {failure}" for failure in failures]
    return _close(lines, bool(failures))


def _close(lines: list[str], failed: bool) -> tuple[int, list[str]]:
    """The report's last lines (what to do about BAD files, the verdict) and
    the exit status."""
    if any(line.startswith("  BAD ") for line in lines):
        lines.append(
            "  to repair: delete the BAD files and rerun the extract that wrote "
            "them; it writes them again"
        )
    lines.append("verify: " + ("FAILED" if failed else "ok"))
    return (1 if failed else 0), lines
