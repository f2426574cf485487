"""``make bench-gpu``'s measurements, each run in a process of its own by
``gpu_bench.py --part NAME`` (an engine per process, as a user runs them).
Each returns a dict the driver reads from the process's last ``BENCH`` line.

The peer at its best: ``prefill`` and ``native`` warm up on one batch, then
time ``PASSES`` passes over the whole data set and keep the fastest; the
driver runs each at vLLM's default ``gpu_memory_utilization`` and at the one
``extract`` uses, and counts the faster."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from statistics import median
from typing import Any

from gpu_models import DUMMY_WEIGHTS, MODELS, build_model, state_bytes_per_token
from gpu_profiles import profiled, worker_profiled
from gpu_reuse_calls import part_reuse_calls
from plan import extract_timing

MAX_MODEL_LEN = 2048
BATCH = 32
PASSES = 2
EXTRACT_UTILIZATION = 0.8  # extract's default (specshim.job.extract.options)


def label(part: str, **options: Any) -> str:
    """A run's name in the results and its logs: the part and its variants
    (extract@32768: a step budget; extract@t4: the writer's pool at 4
    threads; generate@b128: 128 sequences a call; prefill@0.8: a memory
    setting)."""
    marks = {"threads": "t", "batch": "b", "hold": "h"}
    return part + "".join(f"@{marks.get(k, '')}{v}" for k, v in options.items() if v)


def batch_size(args: argparse.Namespace) -> int:
    """Sequences per generate() call: ``--batch`` where given, else 32
    (extract's default)."""
    return int(getattr(args, "batch", 0) or BATCH)


def _engine(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's engine as the reference runs it: eager, no prefix caching (as
    speculators' generator runs it), at ``--util`` where given."""
    engine = {
        "model": str(args.model_dir),
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "max_model_len": MAX_MODEL_LEN,
        "skip_tokenizer_init": True,
    }
    if args.util != "default":
        engine["gpu_memory_utilization"] = float(args.util)
    if args.model in DUMMY_WEIGHTS:
        engine["load_format"] = "dummy"
    return engine


def _best(passes: list[float]) -> dict[str, Any]:
    return {"seconds": min(passes), "passes": [round(p, 3) for p in passes]}


def part_prefill(args: argparse.Namespace, data: list[list[int]]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(**_engine(args))
    params = SamplingParams(max_tokens=1, detokenize=False)
    prompts = [{"prompt_token_ids": ids} for ids in data]
    llm.generate(prompts[:BATCH], params, use_tqdm=False)  # warm-up
    passes = []
    for _ in range(PASSES):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        passes.append(time.perf_counter() - start)
    return _best(passes) | _settings(llm)


def _settings(llm: Any) -> dict[str, Any]:
    """The engine's settings in force, named in the results."""
    config = getattr(llm.llm_engine, "vllm_config", None)
    if config is None:
        return {"settings": "unknown (no llm_engine.vllm_config)"}
    return {
        "settings": {
            "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "enforce_eager": config.model_config.enforce_eager,
            "prefix_caching": config.cache_config.enable_prefix_caching,
        }
    }


def part_native(args: argparse.Namespace, data: list[list[int]]) -> dict[str, Any]:
    """vLLM's own extraction, each pass timed until every file is whole."""
    from vllm import LLM, SamplingParams

    out = args.work / "native"
    shutil.rmtree(out, ignore_errors=True)  # the disk holds one set
    out.mkdir(parents=True)
    ids = [k + 1 for k in MODELS[args.model][2]]  # residual after k + 1 layers
    llm = LLM(
        **_engine(args),
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": ids}
            },
        },
        kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(out)},
        },
    )
    params = SamplingParams(max_tokens=1, detokenize=False)
    prompts = [{"prompt_token_ids": ids} for ids in data]
    _native_pass(llm, prompts[:BATCH], params, out)  # warm-up
    passes, size = [], 0
    for _ in range(PASSES):
        seconds, size = _native_pass(llm, prompts, params, out)
        passes.append(seconds)
    return _best(passes) | {"bytes": size} | _settings(llm)


def _native_pass(llm: Any, prompts: list[Any], params: Any, out: Any) -> tuple:
    """Seconds until every file is written (the writer holds each file's lock
    until it is whole), and their bytes; the files are removed after."""
    import fcntl

    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    paths = [o.kv_transfer_params["hidden_states_path"] for o in outputs]
    for path in paths:
        with open(path + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
    seconds = time.perf_counter() - start
    size = sum(os.path.getsize(p) for p in paths)
    for entry in out.iterdir():
        entry.unlink()
    return seconds, size


def generate_budget(args: argparse.Namespace) -> int:
    """The tokens a step generate() runs at: ``--budget``, else extract's
    default on a GPU."""
    from specshim._settings import GPU_STEP_DEFAULTS

    return int(args.budget or GPU_STEP_DEFAULTS["max_batched_tokens"])


def set_generate_budget(args: argparse.Namespace) -> int:
    """Put ``generate_budget`` in force for generators made from now on, and
    return it. With ``configure()``: a ``SPECSHIM_*`` variable is read once, at
    ``import specshim``, and ``generate_budget`` has imported specshim by
    then (a variable set here ran every generate() at speculators' 8,192)."""
    import specshim  # first: it arms the patches speculators needs

    budget = generate_budget(args)
    specshim.configure(max_batched_tokens=budget)
    return budget


def make_generator(args: argparse.Namespace) -> Any:
    """speculators' generator on ``--model``'s checkpoint, as extract makes it."""
    import importlib

    return importlib.import_module(
        "speculators.data_generation"
    ).VllmHiddenStatesGenerator(
        str(args.model_dir),
        layer_ids=MODELS[args.model][2],
        max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=EXTRACT_UTILIZATION,
    )


def part_generate(args: argparse.Namespace, data: list[list[int]]) -> dict[str, Any]:
    """speculators' generate() with specshim, batches of 32, no files; at
    ``--budget`` tokens a step where given (extract's --max-batched-tokens),
    else at the budget ``extract`` takes on a GPU, so that extract ÷
    generate compares the two at one step budget."""
    budget = set_generate_budget(args)
    from specshim.testing.worker_probes import backends, early_fetches

    if args.model in DUMMY_WEIGHTS:
        from dummy_weights import install

        install()

    generator = make_generator(args)
    size = batch_size(args)
    batches = [data[i : i + size] for i in range(0, len(data), size)]
    start = time.perf_counter()
    generator.generate(batches[0])  # warm-up, untimed (extract times its first)
    first = time.perf_counter() - start
    passes, calls = [], []
    for _ in range(PASSES):
        held: deque[Any] = deque(maxlen=args.hold)  # as extract's writer holds
        start = time.perf_counter()
        for batch in batches:
            began = time.perf_counter()
            held.append(generator.generate(batch))
            calls.append(time.perf_counter() - began)
        passes.append(time.perf_counter() - start)
        held.clear()
    rpc = generator.executor.collective_rpc
    found = _best(passes) | {"backends": rpc(backends)[0]}
    found["calls_s"] = {"first": round(first, 3), "median": round(median(calls), 3)}
    # The calls whose rows left as they were captured (early_copies).
    found["early_fetches"] = f"{rpc(early_fetches)[0]} of {1 + PASSES * len(batches)}"
    # What the scheduler ran at, read back: the figure names its real budget.
    ran = int(generator.vllm_config.scheduler_config.max_num_batched_tokens)
    if ran != budget:
        raise RuntimeError(f"generate ran at {ran} tokens a step, asked {budget}")
    found["max_batched_tokens"] = ran
    found["batch_size"] = size
    cache = generator.vllm_config.cache_config  # what speculators sized it to
    found["kv_cache_tokens"] = int(cache.num_gpu_blocks or 0) * cache.block_size
    if args.profile:
        found["profile"] = profiled(generator, batches[: args.profile])
    if args.worker_profile:
        found["worker_profile"] = worker_profiled(
            generator, batches[: args.worker_profile]
        )
    generator.executor.shutdown()
    return found


def part_extract(args: argparse.Namespace, data: list[list[int]]) -> dict[str, Any]:
    """``specshim extract`` end to end, the best of ``PASSES`` runs, as
    ``generate()`` is counted (each run a process of its own, cold as a
    user's: the second finds the first's compiled kernels on disk); its own
    rate (from the first generate()) and its closing line of where the time
    went."""
    layers = ",".join(str(k) for k in MODELS[args.model][2])
    specshim = ["-m", "specshim"]
    if args.model in DUMMY_WEIGHTS:  # specshim, its generator's weights drawn
        specshim = [str(Path(__file__).with_name("dummy_weights.py"))]
    command = [
        *(sys.executable, *specshim, "extract"),
        *("--model", str(args.model_dir), "--data", str(args.work / "data.jsonl")),
        *("--out", str(args.work / "extract-out"), "--layers", layers),
        *("--max-model-len", str(MAX_MODEL_LEN)),
        *("--batch-size", str(batch_size(args))),
    ]
    if args.budget:
        command += ["--max-batched-tokens", str(args.budget)]
    env = dict(os.environ)
    if args.threads:  # the writer's pool (extract's own choice: 8 on a GPU host)
        env["SPECSHIM_WRITER_THREADS"] = str(args.threads)
    name = label("extract", budget=args.budget, threads=args.threads, batch=args.batch)
    runs = [
        _extract_once(args, data, command, env, f"{name}-{args.model}{suffix}")
        for suffix in ["", *(f"-run{n}" for n in range(2, PASSES + 1))]
    ]
    found = min(runs, key=lambda run: run["seconds"])
    return found | {"passes": [round(run["seconds"], 3) for run in runs]}


def _extract_once(
    args: argparse.Namespace,
    data: list[list[int]],
    command: list[str],
    env: dict[str, str],
    name: str,
) -> dict[str, Any]:
    out = args.work / "extract-out"
    shutil.rmtree(out, ignore_errors=True)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    (args.results / f"{name}.specshim.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"extract exited {done.returncode}: {done.stderr[-800:]}")
    line = [x for x in done.stdout.splitlines() if x.startswith("extract: wrote")][-1]
    rate = float(line.rsplit(" at ", 1)[1].split(" tok/s")[0].replace(",", ""))
    tokens = sum(len(ids) for ids in data)
    size = sum(p.stat().st_size for p in out.glob("data_*.pt"))
    shutil.rmtree(out, ignore_errors=True)  # the next part's disk space
    found = {"seconds": tokens / rate, "bytes": size, "line": line}
    budget = re.search(r"max_batched_tokens=(\d+) \(([^)]*)\)", done.stderr)
    if budget:  # the step budget in force, and where it came from
        found["max_batched_tokens"] = [int(budget.group(1)), budget.group(2)]
    timing = extract_timing(done.stderr)
    if timing:
        found["timing"] = timing
    return found


def part_disk(args: argparse.Namespace, data: list[list[int]]) -> dict[str, Any]:
    """bytes/s writing files the size of an average sample's: into the page
    cache with 1 to 16 threads (as native's 8 writer threads do; the best
    counts), and with an fsync per file from one thread."""
    per_token = state_bytes_per_token(args.model)
    size = int(per_token * sum(map(len, data)) / len(data))
    count = max(16, (4 << 30) // size)
    where = args.work / "disk"
    where.mkdir(parents=True, exist_ok=True)
    payload = os.urandom(size)
    found: dict[str, Any] = {"file_bytes": size, "files": count, "threads": {}}
    for threads in (1, 2, 4, 8, 16):
        found["threads"][threads] = _write_files(where, payload, count, threads)
    best = max(found["threads"], key=found["threads"].get)
    found["nofsync_bytes_per_s"] = found["threads"][best]
    found["nofsync_threads"] = best
    found["fsync_bytes_per_s"] = _write_files(where, payload, count // 4, 1, True)
    return found


def _write_files(where: Any, payload: bytes, count: int, threads: int, sync=False):
    def write(first: int) -> None:
        for i in range(first, count, threads):
            with open(where / f"f{i}", "wb") as handle:
                handle.write(payload)
                if sync:
                    handle.flush()
                    os.fsync(handle.fileno())

    workers = [threading.Thread(target=write, args=(k,)) for k in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    rate = len(payload) * count / (time.perf_counter() - start)
    for i in range(count):
        os.unlink(where / f"f{i}")
    return rate


REUSE_SAMPLES = 256  # a data set's two runs' files fit the lent host's disk


def part_reuse(args: argparse.Namespace, data: list[list[int]]) -> dict[str, Any]:
    """Issue 47's data sets (``reuse_bench.py``): ``extract --reuse-prefixes``
    against ``extract``, one run a side, the flag's first (a fresh host's
    first-run cost then understates the speedup: performance.md, tenth
    lease), files compared; ``--profile``, ``--worker-profile N``: its profiles
    too (more engine starts: give the part a call of its own)."""
    if args.model in DUMMY_WEIGHTS:
        raise RuntimeError("reuse runs extract on a checkpoint with weights")
    name = label("reuse") + f"-{args.model}"
    command = [
        *(sys.executable, str(Path(__file__).with_name("reuse_bench.py"))),
        *("--model-dir", str(args.model_dir), "--order", "BA"),
        *("--layers", ",".join(str(k) for k in MODELS[args.model][2])),
        *("--samples", str(REUSE_SAMPLES), "--results", str(args.results)),
        *("--name", name),
        *(["--profile"] if args.profile else []),
        *(["--worker-profile", str(args.worker_profile)] * bool(args.worker_profile)),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    (args.results / f"{name}.bench.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(
            f"reuse_bench exited {done.returncode}: {done.stdout[-800:]}"
        )
    found = json.loads((args.results / f"{name}.json").read_text())
    return {
        kind: {
            "speedup": row["speedup"],
            "goal": row["goal"],
            "samples": row["samples"],
            "samples_per_second": row["samples_per_second"],
            "identical": row["agreement"].get("identical"),
        }
        for kind, row in found["datasets"].items()
    }


def part_build(args: argparse.Namespace, data: list[list[int]]) -> dict[str, Any]:
    """In a process of its own: the GPU memory it used is free for the rest."""
    build_model(args.model, args.model_dir)
    return {"model": str(args.model_dir)}


PARTS = {
    "build": part_build,
    "prefill": part_prefill,
    "native": part_native,
    "generate": part_generate,
    "generate-v1": part_generate,
    "extract": part_extract,
    "disk": part_disk,
    "reuse": part_reuse,
    "reuse-calls": part_reuse_calls,
}

# Parts that outlast --part-timeout's default: six engine starts.
PART_TIMEOUTS = {"reuse": 560}
