"""``specshim extract``: a dataset in, speculators training files out.

Sample i of the dataset always lands in ``OUT/data_{i}.pt`` (the layout
speculators 0.3.0's trainer reads: ``input_ids``, ``hidden_states`` as one
tensor per layer in layer order, ``loss_mask``). Files are written under a
hidden temporary name that does not end in ``pt`` and renamed into place, so a
killed run never leaves a partial file where the trainer would pick it up.

Rerunning the same command resumes. What is already there is judged by
content (``specshim.job.store``): a file counts as done only if a manifest line
describes that very file and says it holds what sample i of the dataset holds
now; anything else is rewritten, and the run says how many and why. The
settings (model, layers, max length, vLLM and speculators versions) are fixed
by the first sample written, in ``data_config.json``. ``--shard I/N`` takes
samples with ``i % N == I``; any number of shards, on any hosts sharing the
directory, can write into it at once.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specshim import _settings
from specshim._base import PACKAGES, SpecShimError, UsageError
from specshim._settings import DEFAULT_BATCH_SIZE, STEP_DEFAULTS, trust_remote_code
from specshim._versions import installed_version
from specshim.job import store as _store
from specshim.job.dataset import warn_truncated
from specshim.job.feed import Feed, FeedSpec, Todo
from specshim.job.store import final_path

logger = logging.getLogger(__name__)

# Keys of data_config.json that must agree before a run may add to a directory.
# The dataset is not among them: samples are identified by content.
RUN_IDENTITY = ("model_fingerprint", "layers", "max_model_len", "versions")
# Versions that change what the states are; others (torch, transformers) are
# recorded only.
PINNED_VERSIONS = ("vllm", "speculators")
# Files that decide how a checkpoint tokenizes and what its model is.
_MODEL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


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


def step_settings(options: ExtractOptions) -> dict[str, Any]:
    """Put this run's step budget in force (flag > environment > STEP_DEFAULTS)."""
    flags = {knob.name: getattr(options, knob.name) for knob in _settings.KNOBS}
    return _settings.apply_resolved(_settings.resolve(flags, STEP_DEFAULTS, "extract"))


def parse_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(
            f"--layers {text!r}: expected comma-separated integers"
        ) from None


def _text_config(model: Path, flag: str = "--model") -> tuple[Path, dict[str, Any]]:
    """The checkpoint's config.json, and its text part (multimodal wrappers)."""
    if not model.is_dir():
        raise UsageError(f"{flag} {model}: no such directory (a local checkpoint)")
    config_file = model / "config.json"
    if not config_file.is_file():
        raise UsageError(f"{flag} {model}: no config.json, not a checkpoint directory")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{config_file}: not a readable JSON file ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{config_file}: not a JSON object")
    return config_file, {**config, **(config.get("text_config") or {})}


def _config_int(model: Path, *keys: str) -> tuple[int, ...]:
    config_file, config = _text_config(model)
    try:
        return tuple(int(config[key]) for key in keys)
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"{config_file}: cannot find {' and '.join(keys)}") from None


def model_facts(model: Path) -> tuple[int, int]:
    """(number of decoder layers, vocabulary size) from the checkpoint's config.json."""
    layers, vocab = _config_int(model, "num_hidden_layers", "vocab_size")
    return layers, vocab


def hidden_size(model: Path) -> int:
    return _config_int(model, "hidden_size")[0]


def choose_layers(requested: list[int] | None, num_layers: int) -> list[int]:
    """The requested layers, checked; or speculators 0.3.0's automatic choice."""
    if requested is None:
        # speculators' own default in VllmHiddenStatesGenerator.__init__, whose
        # ids coincide on small models (6 layers: 2, 3, 3, 5): each layer once.
        auto = [2, num_layers // 2, num_layers - 3, num_layers - 1]
        return sorted({i for i in auto if 0 <= i < num_layers})
    if not requested:
        raise UsageError("--layers is empty")
    bad = [i for i in requested if not 0 <= i < num_layers]
    if bad:
        raise UsageError(
            f"--layers {bad} out of range: the model has {num_layers} decoder "
            f"layers, valid ids are 0..{num_layers - 1}"
        )
    if len(set(requested)) != len(requested) or requested != sorted(requested):
        raise UsageError(
            f"--layers {requested}: give distinct ids in increasing order "
            "(captured states are stored in layer order)"
        )
    return requested


def model_fingerprint(model: Path) -> str:
    """The checkpoint by content: config, tokenizer files, weight file sizes.

    Not its path, so another mount point on another node is the same model.
    Weights are not read (too large); their names and sizes are taken.
    """
    import hashlib

    digest = hashlib.blake2b(digest_size=16)
    for name in _MODEL_FILES:
        path = model / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    for path in sorted(model.glob("*.safetensors")) + sorted(model.glob("*.bin")):
        digest.update(f"{path.name}:{path.stat().st_size}\0".encode())
    return digest.hexdigest()


def run_identity(options: ExtractOptions, layers: list[int]) -> dict[str, Any]:
    return {
        "model_fingerprint": model_fingerprint(options.model),
        "layers": layers,
        "max_model_len": options.max_model_len,
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


def _config(identity: dict[str, Any], options: ExtractOptions) -> dict[str, Any]:
    import specshim

    config = dict(identity)
    config.update(
        model=str(options.model.resolve()),
        tensor_parallel_size=options.tp,
        format="speculators-0.3.0 hidden states (data_{i}.pt per sample)",
        files="data_{i}.pt holds sample i of the dataset",
        hidden_states="one tensor per layer, in the order of 'layers'",
        recorded_versions={n: installed_version(n) for n in PACKAGES}
        | {"specshim": specshim.__version__},
    )
    return config


def save_sample(run: _store.Run, todo: Todo, result: dict[str, Any]) -> int:
    """Write one sample under a temporary name, record it, rename it into place."""
    import torch

    ids = torch.frombuffer(todo.input_ids, dtype=torch.int32).to(torch.long)
    returned = result["input_ids"]
    if returned.shape != ids.shape or not torch.equal(returned.to(torch.long), ids):
        raise SpecShimError(
            f"sample {todo.index} ({todo.where}): the generator returned other "
            "input ids than it was given"
        )
    data = {
        "input_ids": returned,
        "hidden_states": result["hidden_states"],
        "loss_mask": torch.frombuffer(todo.loss_mask, dtype=torch.int8).to(torch.long),
    }
    final = final_path(run.out, todo.index)
    tmp = run.partial_path(final.name)
    torch.save(data, tmp)
    stat = tmp.stat()
    run.record(
        _store.Entry(
            index=todo.index,
            tokens=todo.tokens,
            record=todo.record,
            size=stat.st_size,
            inode=stat.st_ino,
            mtime_ns=stat.st_mtime_ns,
            num_tokens=len(todo),
            truncated=todo.truncated,
        )
    )
    os.replace(tmp, final)
    return stat.st_size


class _Progress:
    """A bar on a terminal; otherwise a log line at most every 30 seconds."""

    def __init__(self, bar: bool) -> None:
        self.done = self.tokens = 0
        self.started = self.last_log = time.monotonic()
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(unit="sample", dynamic_ncols=True)

    def update(self, samples: int, tokens: int) -> None:
        self.done += samples
        self.tokens += tokens
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.tokens / elapsed
        if self.bar is not None:
            self.bar.set_postfix_str(f"{rate:,.0f} tok/s")
            self.bar.update(samples)
        elif time.monotonic() - self.last_log >= 30:
            self.last_log = time.monotonic()
            logger.info(
                "extract: %d samples written, %.0f tok/s (specshim status --out "
                "DIR --data D shows what is left)",
                self.done,
                rate,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Writer:
    """Writes batch k's files while batch k+1 generates: a thread, one batch deep.

    ``put`` blocks while a batch waits (backpressure: at most one batch
    generating, one waiting and one being written). The first failure stops
    the thread; the next ``put``, ``check`` or ``finish`` raises it.
    """

    def __init__(self, run: _store.Run, progress: _Progress) -> None:
        self.run, self.progress = run, progress
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.written = self.tokens = 0
        self.error: SpecShimError | None = None
        self.thread = threading.Thread(
            target=self._loop, name="specshim-writer", daemon=True
        )
        self.thread.start()

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            batch, results = item
            todo = batch[0]
            try:
                for todo, result in zip(batch, results, strict=True):
                    save_sample(self.run, todo, result)
                    self.written += 1
                    self.tokens += len(todo)
                self.progress.update(len(batch), sum(len(t) for t in batch))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self.error = SpecShimError(
                    f"writing data_{todo.index}.pt failed "
                    f"({type(exc).__name__}: {exc}); the run stopped. The "
                    f"{self.written} samples it wrote are complete: fix the "
                    "cause (disk space, quota, permissions) and rerun the "
                    "same command to resume."
                )
                self.error.__cause__ = exc
                return

    def check(self) -> None:
        if self.error is not None:
            raise self.error
        if not self.thread.is_alive() and not self.queue.empty():
            raise SpecShimError(
                "the writer thread stopped with batches still to write (a "
                "specshim bug; please report it); rerun the same command to resume"
            )

    def put(self, batch: list[Todo], results: list[dict[str, Any]]) -> None:
        while True:
            self.check()
            if not self.thread.is_alive():
                raise SpecShimError(
                    "the writer thread is gone (a specshim bug; please report "
                    "it); rerun the same command to resume"
                )
            try:
                self.queue.put((batch, results), timeout=0.5)
                return
            except queue.Full:
                continue

    def finish(self) -> None:
        """Write what is queued, stop the thread; raise its failure if any."""
        while self.thread.is_alive():
            try:
                self.queue.put(None, timeout=0.5)
                break
            except queue.Full:
                continue
        self.thread.join()
        self.check()


def extract(options: ExtractOptions) -> dict[str, Any]:
    """Run the job; returns counts. Raises SpecShimError on bad input or a crash.

    The step budget it sets (``step_settings``) is undone on return.
    """
    kv_space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    try:
        with _settings.preserved():
            return _extract(options)
    finally:
        if kv_space is None:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = kv_space


def _check_options(options: ExtractOptions) -> None:
    if options.max_model_len < 2:
        raise UsageError("--max-model-len must be at least 2")
    for flag, value in (("--batch-size", options.batch_size), ("--tp", options.tp)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if not 0 < options.gpu_memory_utilization <= 1:
        raise UsageError("--gpu-memory-utilization must be in (0, 1]")
    if options.cpu_kv_space_gib is not None and options.cpu_kv_space_gib < 1:
        raise UsageError("--cpu-kv-space-gib must be at least 1")
    kv_env = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if kv_env and not kv_env.isdigit():
        raise UsageError(
            f"VLLM_CPU_KVCACHE_SPACE={kv_env!r}: vLLM expects a whole number of GiB"
        )


def check_against_model(model: Path, max_model_len: int, tp: int) -> None:
    """What vLLM would refuse of these values for this checkpoint, refused
    first, in one line naming the flag and the model's limit."""
    config_file, config = _text_config(model)
    positions = config.get("max_position_embeddings")
    # Where rope scaling stretches the positions, vLLM computes the limit.
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else "?"
    scaled = kind not in (None, "default")
    if isinstance(positions, int) and not scaled and max_model_len > positions:
        raise UsageError(
            f"--max-model-len {max_model_len}: the model has {positions} positions "
            f"(max_position_embeddings in {config_file}); give at most {positions}"
        )
    heads = config.get("num_attention_heads")
    if isinstance(heads, int) and heads % tp:
        divisors = [n for n in range(1, heads + 1) if heads % n == 0]
        raise UsageError(
            f"--tp {tp}: the model's {heads} attention heads must split evenly "
            f"over the tensor-parallel ranks; use one of {divisors}"
        )


def _extract(options: ExtractOptions) -> dict[str, Any]:
    # Cheap checks first: flags, paths and what --out already holds, before the
    # dataset is read or a model is loaded.
    num_layers, vocab_size = model_facts(options.model)
    layers = choose_layers(options.layers, num_layers)
    _check_options(options)
    check_against_model(options.model, options.max_model_len, options.tp)
    settings = step_settings(options)
    if not options.data.exists():
        raise UsageError(f"--data {options.data}: no such file or directory")
    _store.prepare_out(options.out)
    identity = run_identity(options, layers)
    existing = _store.read_config(options.out)
    if existing is not None:
        check_identity(options.out, existing, identity)
    run = _store.Run(options.out, {"shard": list(options.shard)})
    run.start()
    feed = None
    try:
        cleaned = run.remove_dead_partials()
        if cleaned:
            logger.info("extract: removed %d leftovers of runs that died", cleaned)
        feed = Feed(
            FeedSpec(
                data=options.data,
                model=options.model,
                out=options.out,
                shard=options.shard,
                split=options.split,
                column=options.column,
                vocab_size=vocab_size,
                max_len=options.max_model_len - 1,
                trust_remote_code=trust_remote_code(),
            )
        ).start()
        logger.info(
            "extract: streaming %s (shard %d/%d), layers %s; step budget %s",
            options.data,
            *options.shard,
            layers,
            ", ".join(f"{k}={v['value']} ({v['source']})" for k, v in settings.items()),
        )
        pipeline = _Pipeline(options, layers, settings, identity, run)
        counts = pipeline.run(feed)
        run.annotate({"dataset_samples": feed.total, "finished": time.time()})
        warn_truncated(feed.truncated, feed.samples, options.max_model_len - 1)
        _handle_orphans(options, feed.total, run.id)
        for why, count in feed.rewrites.items():
            logger.warning("extract: rewrote %d file(s): %s", count, why)
        if not counts["written"]:
            logger.info(
                "extract: all %d samples of this shard already exist", feed.done
            )
        return counts | {
            "shard_samples": feed.samples,
            "dataset_samples": feed.total,
            "skipped": feed.done,
            "rewritten": dict(feed.rewrites),
        }
    finally:
        if feed is not None:
            feed.close()
        run.close()


def _handle_orphans(options: ExtractOptions, total: int, run: str) -> None:
    """Files past the dataset's end are moved aside (``--move-orphans``) or
    refused: speculators' trainer would read them as training data."""
    found = _store.orphans(_store.existing_files(options.out), total)
    if not found:
        return
    names = ", ".join(f"data_{i}.pt" for i in found[:3]) + (
        " ..." if len(found) > 3 else ""
    )
    if options.move_orphans:
        folder = _store.move_orphans(options.out, found, run)
        logger.warning(
            "extract: moved %d file(s) of samples %s does not have (%s) to %s",
            len(found),
            options.data,
            names,
            folder,
        )
        return
    raise UsageError(
        f"{options.out} holds {len(found)} file(s) of samples {options.data} does "
        f"not have ({names}; it has {total} samples), which speculators' trainer "
        "would read; every sample of the dataset is written. Rerun with "
        "--move-orphans to move them to .specshim/orphans/, or delete them"
    )


class _Pipeline:
    """Batches the feed, generates, and hands each batch to the writer.

    The generator is built when the first batch is full (or the feed ends), so
    a bad record among the first samples, or a shard with nothing left to do,
    never loads a model. Whatever stops the run, the batches already generated
    are written before the error is raised.
    """

    def __init__(
        self,
        options: ExtractOptions,
        layers: list[int],
        settings: dict[str, Any],
        identity: dict[str, Any],
        run: _store.Run,
    ) -> None:
        self.options, self.layers, self.settings = options, layers, settings
        self.identity, self.run_ = identity, run
        self.generator: Any = None
        self.writer: _Writer | None = None
        self.progress: _Progress | None = None
        self.published = False
        self.began = time.monotonic()
        self.first_generate: float | None = None  # seconds from the start

    def run(self, feed: Feed) -> dict[str, Any]:
        batch: list[Todo] = []
        try:
            for todo in feed:
                batch.append(todo)
                if len(batch) == self.options.batch_size:
                    self._step(batch)
                    batch = []
            if batch:
                self._step(batch)
            if self.writer is not None:
                self.writer.finish()
        except BaseException:
            if self.writer is not None:
                _drain(self.writer)  # what was generated is still written
            raise
        finally:
            if self.progress is not None:
                self.progress.close()
            if self.generator is not None:
                _shutdown(self.generator)
        if self.writer is None:
            return {"written": 0, "tokens": 0, "seconds": 0.0}
        assert self.first_generate is not None
        return {
            "written": self.writer.written,
            "tokens": self.writer.tokens,
            "seconds": time.monotonic() - self.began - self.first_generate,
            "first_generate_seconds": self.first_generate,
        }

    def _start(self) -> None:
        options = self.options
        if _on_cpu():
            budget = int(self.settings["max_batched_tokens"]["value"])
            space, source = cpu_kv_space(options, budget)
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(space)
            logger.info("extract: vLLM CPU KV-cache space %d GiB (%s)", space, source)
        self.generator = _make_generator(options, self.layers)
        bar = sys.stderr.isatty() if options.progress is None else options.progress
        self.progress = _Progress(bar)
        self.writer = _Writer(self.run_, self.progress)

    def _step(self, batch: list[Todo]) -> None:
        if self.generator is None:
            self._start()
        assert self.writer is not None
        self.writer.check()
        if self.first_generate is None:
            self.first_generate = time.monotonic() - self.began
        results = _generate(self.generator, batch, self.writer)
        if len(results) != len(batch):
            raise SpecShimError(
                f"the generator returned {len(results)} results for {len(batch)} "
                "samples; nothing of this batch was written"
            )
        if not self.published:  # the settings are fixed by the first sample
            in_force = self.run_.publish_config(_config(self.identity, self.options))
            check_identity(self.options.out, in_force, self.identity)
            self.published = True
        self.writer.put(batch, results)


def kv_bytes_per_token(model: Path) -> int:
    """An upper estimate of one token's KV cache (bfloat16, every layer).

    Multi-head latent attention runs as plain attention on the CPU backend
    (``VLLM_MLA_DISABLE``): K and V then span every head.
    """
    _, config = _text_config(model)
    layers = int(config.get("num_hidden_layers", 1))
    heads = int(config.get("num_attention_heads", 1))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    if "kv_lora_rank" in config:
        nope = int(config.get("qk_nope_head_dim") or 0)
        rope = int(config.get("qk_rope_head_dim") or 0)
        v_dim = int(config.get("v_head_dim") or nope + rope)
        per_layer = heads * (max(nope + rope, v_dim) * 2)
    else:
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        per_layer = 2 * kv_heads * head_dim
    return layers * per_layer * 2


def cpu_kv_space(options: ExtractOptions, max_batched_tokens: int) -> tuple[int, str]:
    """vLLM's CPU KV-cache space for this job, in GiB, and where it came from.

    speculators gives its KV cache ``space * gpu_memory_utilization *
    cache_memory_fraction``; the job needs one step's tokens (at least one
    whole sequence), twice over for block rounding. The machine caps it at
    half of the memory available now. vLLM's own default is most of the
    machine's free memory.
    """
    if options.cpu_kv_space_gib is not None:
        return options.cpu_kv_space_gib, "--cpu-kv-space-gib"
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip():
        return int(os.environ["VLLM_CPU_KVCACHE_SPACE"]), "VLLM_CPU_KVCACHE_SPACE"
    fraction = _settings.settings()["cache_memory_fraction"]["value"]
    tokens = max(max_batched_tokens, options.max_model_len)
    need = 2 * tokens * kv_bytes_per_token(options.model)
    need /= options.gpu_memory_utilization * float(fraction)
    gib = 1 << 30
    available = _available_memory() // 2
    return max(1, min(-(-int(need) // gib), available // gib)), "the job's need"


def _available_memory() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _make_generator(options: ExtractOptions, layers: list[int]) -> Any:
    # specshim is imported (this module is part of it), so the patches are
    # armed before speculators' modules load here.
    from speculators.data_generation import VllmHiddenStatesGenerator

    try:
        return VllmHiddenStatesGenerator(
            str(options.model),
            layer_ids=layers,
            max_model_len=options.max_model_len,
            gpu_memory_utilization=options.gpu_memory_utilization,
            tensor_parallel_size=options.tp,
        )
    except SpecShimError:
        raise
    except Exception as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        # vLLM's config classes validate with pydantic, before any worker
        # starts: what they refuse is a value given here, said in one line.
        if type(exc).__name__ == "ValidationError":
            reason = (lines[1:] or lines or [repr(exc)])[0]
            reason = reason.removeprefix("Value error, ")
            raise UsageError(f"vLLM refused these settings: {reason}") from None
        # Anything else stopped the workers from starting: vLLM logged why.
        first = lines[0] if lines else ""
        raise SpecShimError(
            f"the generator could not start ({type(exc).__name__}: {first}); the "
            "vLLM log above says why. Nothing was written in this run."
        ) from exc


def _generate(generator: Any, batch: list[Todo], writer: _Writer) -> list[Any]:
    try:
        return generator.generate([t.input_ids.tolist() for t in batch])
    except Exception as exc:
        if getattr(generator.executor, "is_failed", False):
            _drain(writer)  # the batches already generated are written
            raise SpecShimError(
                "a vLLM worker process died during extraction (see its log above: "
                "out of memory and a killed process are the usual causes). "
                f"{writer.written} samples were written in this run and are "
                "complete; rerun the same command to resume from there."
            ) from exc
        raise


def _drain(writer: _Writer) -> None:
    """Let the writer finish what is queued while another error stops the run;
    its own failure, if any, is logged rather than lost."""
    try:
        writer.finish()
    except SpecShimError as exc:
        logger.error("extract: %s", exc)


def _shutdown(generator: Any) -> None:
    try:
        generator.executor.shutdown()
    except Exception:  # noqa: BLE001 - best effort on the way out
        logger.debug("executor shutdown failed", exc_info=True)
