"""``specshim extract``: a dataset in, speculators training files out.

Sample i of the dataset always lands in ``OUT/data_{i}.pt`` (the layout
speculators 0.3.0's trainer reads: ``input_ids``, ``hidden_states`` as one
tensor per layer in layer order, ``loss_mask``). Files are written under a
hidden temporary name that does not end in ``pt`` and renamed into place, so a
killed run never leaves a partial file where the trainer would pick it up;
rerunning the same command skips what exists. ``--shard I/N`` takes samples
with ``i % N == I``, so shards write disjoint names into one directory.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specshim import _settings
from specshim._dataset import Sample, load_samples
from specshim._registry import SpecShimError, installed_version
from specshim._settings import DEFAULT_BATCH_SIZE, STEP_DEFAULTS

logger = logging.getLogger(__name__)

CONFIG_NAME = "data_config.json"
# Keys of data_config.json that must agree before a run may add to a directory.
RUN_IDENTITY = ("model", "layers", "max_model_len", "dataset", "num_samples")


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
    progress: bool | None = None  # None: a bar on a terminal, log lines otherwise
    # Step budget and KV-cache fraction (specshim.configure); None: the
    # SPECSHIM_* variable if set, else STEP_DEFAULTS.
    max_num_seqs: int | None = None
    max_batched_tokens: int | None = None
    cache_memory_fraction: float | None = None


def step_settings(options: ExtractOptions) -> dict[str, Any]:
    """Apply the step budget for this run (flag > environment > STEP_DEFAULTS)."""
    chosen = {}
    for knob in _settings.KNOBS:
        flag = getattr(options, knob.name)
        if flag is not None:
            chosen[knob.name] = flag
        elif not os.environ.get(knob.env, "").strip():
            chosen[knob.name] = STEP_DEFAULTS[knob.name]
    return _settings._configure(chosen, reset=False, caller="extract")


def parse_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SpecShimError(
            f"--layers {text!r}: expected comma-separated integers"
        ) from None


def model_facts(model: Path) -> tuple[int, int]:
    """(number of decoder layers, vocabulary size) from the checkpoint's config.json."""
    if not model.is_dir():
        raise SpecShimError(f"--model {model}: no such directory (a local checkpoint)")
    config_file = model / "config.json"
    if not config_file.is_file():
        raise SpecShimError(
            f"--model {model}: no config.json, not a checkpoint directory"
        )
    config = json.loads(config_file.read_text())
    text = config.get("text_config") or {}
    try:
        layers = text.get("num_hidden_layers", config.get("num_hidden_layers"))
        vocab = text.get("vocab_size", config.get("vocab_size"))
        return int(layers), int(vocab)
    except (TypeError, ValueError):
        raise SpecShimError(
            f"{config_file}: cannot find num_hidden_layers and vocab_size"
        ) from None


def choose_layers(requested: list[int] | None, num_layers: int) -> list[int]:
    """The requested layers, checked; or speculators 0.3.0's automatic choice."""
    if requested is None:
        # speculators' own default in VllmHiddenStatesGenerator.__init__.
        return [2, num_layers // 2, num_layers - 3, num_layers - 1]
    if not requested:
        raise SpecShimError("--layers is empty")
    bad = [i for i in requested if not 0 <= i < num_layers]
    if bad:
        raise SpecShimError(
            f"--layers {bad} out of range: the model has {num_layers} decoder "
            f"layers, valid ids are 0..{num_layers - 1}"
        )
    if len(set(requested)) != len(requested) or requested != sorted(requested):
        raise SpecShimError(
            f"--layers {requested}: give distinct ids in increasing order "
            "(captured states are stored in layer order)"
        )
    return requested


def _identity(
    options: ExtractOptions, layers: list[int], num_samples: int
) -> dict[str, Any]:
    return {
        "model": str(options.model.resolve()),
        "layers": layers,
        "max_model_len": options.max_model_len,
        "dataset": str(options.data.resolve()),
        "num_samples": num_samples,
    }


def _write_config(out: Path, identity: dict[str, Any]) -> None:
    path = out / CONFIG_NAME
    if path.exists():
        existing = json.loads(path.read_text())
        changed = [k for k in RUN_IDENTITY if existing.get(k) != identity[k]]
        if changed:
            details = "; ".join(
                f"{k}: {existing.get(k)!r} there, {identity[k]!r} now" for k in changed
            )
            raise SpecShimError(
                f"{out} holds output of a different run ({details}). Use another "
                "--out, or remove the directory to start over."
            )
        return
    import specshim

    config = dict(identity)
    config.update(
        format="speculators-0.3.0 hidden states (data_{i}.pt per sample)",
        files="data_{i}.pt holds sample i of the dataset",
        hidden_states="one tensor per layer, in the order of 'layers'",
        versions={
            n: installed_version(n)
            for n in ("vllm", "speculators", "torch", "transformers")
        }
        | {"specshim": specshim.__version__},
    )
    _atomic_write(path, json.dumps(config, indent=2).encode())


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def final_path(out: Path, index: int) -> Path:
    return out / f"data_{index}.pt"


def save_sample(out: Path, sample: Sample, result: dict[str, Any]) -> int:
    """Write one sample under a temporary name and rename it into place."""
    import torch

    if result["input_ids"].tolist() != sample.input_ids:
        raise SpecShimError(
            f"sample {sample.index}: the generator returned other input ids"
        )
    record = {
        "input_ids": result["input_ids"],
        "hidden_states": result["hidden_states"],
        "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.long),
    }
    final = final_path(out, sample.index)
    tmp = out / f".data_{sample.index}.{os.getpid()}.partial"
    torch.save(record, tmp)
    os.replace(tmp, final)
    return final.stat().st_size


def _remove_stale_partials(out: Path) -> None:
    for stale in out.glob(".data_*.partial"):
        stale.unlink(missing_ok=True)


class _Progress:
    """A bar on a terminal; otherwise a log line at most every 30 seconds."""

    def __init__(self, total: int, tokens: int, bar: bool) -> None:
        self.total, self.tokens_total = total, tokens
        self.done = self.tokens = 0
        self.started = self.last_log = time.monotonic()
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="sample", dynamic_ncols=True)

    def update(self, samples: int, tokens: int) -> None:
        self.done += samples
        self.tokens += tokens
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.tokens / elapsed
        eta = (self.tokens_total - self.tokens) / rate if rate else float("inf")
        if self.bar is not None:
            self.bar.set_postfix_str(f"{rate:,.0f} tok/s")
            self.bar.update(samples)
        elif time.monotonic() - self.last_log >= 30 or self.done == self.total:
            self.last_log = time.monotonic()
            logger.info(
                "extract: %d/%d samples, %.0f tok/s, ETA %.0f s",
                self.done,
                self.total,
                rate,
                eta,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def extract(options: ExtractOptions) -> dict[str, Any]:
    """Run the job; returns counts. Raises SpecShimError on bad input or a crash.

    The step budget it sets (``step_settings``) is undone on return.
    """
    saved = _settings.snapshot()
    try:
        return _extract(options)
    finally:
        _settings.restore(saved)


def _extract(options: ExtractOptions) -> dict[str, Any]:
    num_layers, vocab_size = model_facts(options.model)
    layers = choose_layers(options.layers, num_layers)
    if options.max_model_len < 2:
        raise SpecShimError("--max-model-len must be at least 2")
    if options.batch_size < 1 or options.tp < 1:
        raise SpecShimError("--batch-size and --tp must be positive")
    settings = step_settings(options)
    samples, total = load_samples(
        options.data,
        options.model,
        vocab_size,
        options.max_model_len - 1,
        options.shard,
    )
    options.out.mkdir(parents=True, exist_ok=True)
    _write_config(options.out, _identity(options, layers, total))
    _remove_stale_partials(options.out)
    pending = [s for s in samples if not final_path(options.out, s.index).exists()]
    counts = {"shard_samples": len(samples), "skipped": len(samples) - len(pending)}
    if not pending:
        logger.info("extract: all %d samples of this shard already exist", len(samples))
        return counts | {"written": 0, "tokens": 0, "seconds": 0.0}
    logger.info(
        "extract: %d samples to write (%d already there), layers %s; step budget %s",
        len(pending),
        counts["skipped"],
        layers,
        ", ".join(f"{k}={v['value']} ({v['source']})" for k, v in settings.items()),
    )
    generator = _make_generator(options, layers)
    bar = sys.stderr.isatty() if options.progress is None else options.progress
    progress = _Progress(len(pending), sum(len(s.input_ids) for s in pending), bar)
    started = time.monotonic()
    written = tokens = 0
    try:
        for start in range(0, len(pending), options.batch_size):
            batch = pending[start : start + options.batch_size]
            results = _generate(generator, batch, written)
            for sample, result in zip(batch, results, strict=True):
                save_sample(options.out, sample, result)
            written += len(batch)
            batch_tokens = sum(len(s.input_ids) for s in batch)
            tokens += batch_tokens
            progress.update(len(batch), batch_tokens)
        seconds = time.monotonic() - started
    finally:
        progress.close()
        _shutdown(generator)
    return counts | {"written": written, "tokens": tokens, "seconds": seconds}


def _make_generator(options: ExtractOptions, layers: list[int]) -> Any:
    from speculators.data_generation import VllmHiddenStatesGenerator

    import specshim  # noqa: F401  (arms the patches before speculators loads)

    return VllmHiddenStatesGenerator(
        str(options.model),
        layer_ids=layers,
        max_model_len=options.max_model_len,
        gpu_memory_utilization=options.gpu_memory_utilization,
        tensor_parallel_size=options.tp,
    )


def _generate(
    generator: Any, batch: list[Sample], written: int
) -> list[dict[str, Any]]:
    try:
        return generator.generate([s.input_ids for s in batch])
    except Exception as exc:
        if getattr(generator.executor, "is_failed", False):
            raise SpecShimError(
                "a vLLM worker process died during extraction (see its log above: "
                "out of memory and a killed process are the usual causes). "
                f"{written} samples were written in this run and are complete; "
                "rerun the same command to resume from there."
            ) from exc
        raise


def _shutdown(generator: Any) -> None:
    try:
        generator.executor.shutdown()
    except Exception:  # noqa: BLE001 - best effort on the way out
        logger.debug("executor shutdown failed", exc_info=True)
