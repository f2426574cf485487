"""One ``specshim extract`` run, planned before anything starts.

``plan_run`` reads the checkpoint once, checks the options against it and
against each other, puts the step budget in force and fixes what the output
will be. What runs after it (the feed, the generator, the writer, the store)
takes its values from the frozen ``RunPlan`` and reads neither the options
nor the checkpoint again: like vLLM's ``VllmConfig``, built and checked in one
place, then handed down whole. Every refusal here comes before a directory is
created, a dataset read or a model loaded.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specshim import _settings
from specshim._base import UsageError, writer_threads
from specshim._settings import GPU_STEP_DEFAULTS, STEP_DEFAULTS, trust_remote_code
from specshim.job.extract.feed import FeedSpec
from specshim.job.extract.options import ExtractOptions
from specshim.job.inputs.checkpoint import ModelFacts, choose_layers, read_model
from specshim.job.kv_cache import VARIABLE as KV_VARIABLE
from specshim.job.kv_cache import kv_need, on_cpu
from specshim.job.outdir.data_config import (
    check_out,
    output_config,
    run_identity,
    truncation_length,
)


@dataclass(frozen=True)
class RunPlan:
    """What an extract run does, decided once (``plan_run``)."""

    model: ModelFacts
    layers: tuple[int, ...]
    max_model_len: int
    max_len: int  # samples are truncated to this many tokens
    tp: int
    gpu_memory_utilization: float
    batch_size: int
    shard: tuple[int, int]
    feed: FeedSpec  # the dataset, the shard and the tokenizer's part
    # The settings in force: the step budget (value and source of each knob).
    settings: dict[str, Any]
    # The output: what its samples depend on (RUN_IDENTITY), and the
    # data_config.json the first sample written publishes.
    identity: dict[str, Any]
    output_config: dict[str, Any]
    progress: bool  # a progress bar, else log lines
    move_orphans: bool
    # vLLM's CPU KV-cache space: the flag, else the job's need in bytes (None:
    # the checkpoint's config does not say enough to estimate it).
    cpu_kv_space_gib: int | None
    kv_need_bytes: float | None
    reuse_prefixes: bool = False
    reuse_cap_mib: int | None = None  # None: what the plan needs

    @property
    def data(self) -> Path:
        return self.feed.data

    @property
    def out(self) -> Path:
        return self.feed.out


def step_settings(options: ExtractOptions) -> dict[str, Any]:
    """Put this run's step budget in force (flag > environment > extract's
    defaults: ``STEP_DEFAULTS``, with ``GPU_STEP_DEFAULTS`` over them where
    vLLM does not compute on the CPU)."""
    flags = {knob.name: getattr(options, knob.name) for knob in _settings.KNOBS}
    defaults = dict(STEP_DEFAULTS)
    if not on_cpu():
        defaults.update(GPU_STEP_DEFAULTS)
    return _settings.apply_resolved(_settings.resolve(flags, defaults, "extract"))


def plan_run(options: ExtractOptions) -> RunPlan:
    """The run's plan, every check made in the order it always was: the model,
    the layers, the flags, what vLLM would refuse of them for this model, the
    step budget (put in force), the dataset's path, what ``--out`` already
    holds. Each room is visited once: the checkpoint, the checks here, the
    output's identity, the KV cache."""
    model = read_model(options.model)
    layers = choose_layers(options.layers, model.num_layers)
    check_options(options)
    check_against_model(model, options.max_model_len, options.tp)
    settings = step_settings(options)
    if not options.data.exists():
        raise UsageError(f"--data {options.data}: no such file or directory")
    identity = run_identity(model.fingerprint, layers, options.max_model_len)
    check_out(options.out, identity)
    config = output_config(identity, options.model, options.tp)
    max_len = truncation_length(options.max_model_len)
    return RunPlan(
        model=model,
        layers=tuple(layers),
        max_model_len=options.max_model_len,
        max_len=max_len,
        tp=options.tp,
        gpu_memory_utilization=options.gpu_memory_utilization,
        batch_size=options.batch_size,
        shard=options.shard,
        feed=_feed_spec(options, model.vocab_size, max_len),
        settings=settings,
        identity=identity,
        output_config=config,
        progress=sys.stderr.isatty() if options.progress is None else options.progress,
        move_orphans=options.move_orphans,
        cpu_kv_space_gib=options.cpu_kv_space_gib,
        kv_need_bytes=_kv_need(options, model, settings),
        reuse_prefixes=options.reuse_prefixes,
        reuse_cap_mib=options.reuse_cap_mib,
    )


def check_options(options: ExtractOptions) -> None:
    """The flags that are wrong whatever the model."""
    if options.max_model_len < 2:
        raise UsageError("--max-model-len must be at least 2")
    for flag, value in (("--batch-size", options.batch_size), ("--tp", options.tp)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if not 0 < options.gpu_memory_utilization <= 1:
        raise UsageError("--gpu-memory-utilization must be in (0, 1]")
    if options.cpu_kv_space_gib is not None and options.cpu_kv_space_gib < 1:
        raise UsageError("--cpu-kv-space-gib must be at least 1")
    if options.reuse_cap_mib is not None:
        if not options.reuse_prefixes:
            raise UsageError("--reuse-cap-mib needs --reuse-prefixes")
        if options.reuse_cap_mib < 0:
            raise UsageError("--reuse-cap-mib must be at least 0")
    writer_threads()  # read by the writer; refused here, before anything starts
    kv_env = os.environ.get(KV_VARIABLE, "").strip()
    if kv_env and not kv_env.isdigit():
        raise UsageError(
            f"{KV_VARIABLE}={kv_env!r}: vLLM expects a whole number of GiB"
        )


def check_against_model(model: ModelFacts, max_model_len: int, tp: int) -> None:
    """What vLLM would refuse of these values for this checkpoint, refused
    first, in one line naming the flag and the model's limit."""
    positions = model.positions
    if positions is not None and max_model_len > positions:
        raise UsageError(
            f"--max-model-len {max_model_len}: the model has {positions} positions "
            f"(max_position_embeddings in {model.config_file}); give at most "
            f"{positions}"
        )
    heads = model.attention_heads
    if heads is not None and heads % tp:
        divisors = [n for n in range(1, heads + 1) if heads % n == 0]
        raise UsageError(
            f"--tp {tp}: the model's {heads} attention heads must split evenly "
            f"over the tensor-parallel ranks; use one of {divisors}"
        )


def _feed_spec(options: ExtractOptions, vocab_size: int, max_len: int) -> FeedSpec:
    return FeedSpec(
        data=options.data,
        model=options.model,
        out=options.out,
        shard=options.shard,
        split=options.split,
        column=options.column,
        vocab_size=vocab_size,
        max_len=max_len,
        trust_remote_code=trust_remote_code(),
    )


def _kv_need(
    options: ExtractOptions, model: ModelFacts, settings: dict[str, Any]
) -> float | None:
    if model.kv_bytes_per_token is None:
        return None
    return kv_need(
        int(settings["max_batched_tokens"]["value"]),
        options.max_model_len,
        model.kv_bytes_per_token,
        options.gpu_memory_utilization,
        float(settings["cache_memory_fraction"]["value"]),
    )
