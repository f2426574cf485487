"""``make bench-gpu``: specshim against vLLM's own speed, on one NVIDIA GPU.

For one model (``--model``), on the same data in the same run, each part in a
process of its own (an engine per process, as a user runs them):

* ``prefill``: vLLM's own ``LLM.generate(max_tokens=1)`` over every sample,
  eager, no prefix caching, vLLM's runner choice; specshim not imported. The
  engine's speed, and the first half of the ceiling.
* ``native``: vLLM's native extraction (``extract_hidden_states`` with
  ``ExampleHiddenStatesConnector``, V1 runner, same layers), the clock stopped
  once every file is written. The peer a user would otherwise pick; vLLM
  refuses MLA models, so the DeepSeek-V3-shaped model has no peer.
* ``generate`` and ``generate-v1``: speculators 0.3.0's ``generate()`` with
  specshim, batches of 32, no files written, under vLLM's runner choice and
  with the V1 runner forced.
* ``extract``: ``specshim extract`` end to end (files written, manifest and
  all), its own rate counted from the first ``generate()``.
* ``disk``: what the output disk writes, in files the size of the average
  sample, with an fsync per file and without. ``extract`` fsyncs its manifest
  (one line per sample), not the data files: a file is done only when the
  manifest describes it (size, inode, mtime), so a file lost in the page cache
  is rewritten, never trusted. Its rule needs the figure without fsync.

The ceiling is the lower of the engine's prefill and the disk's rate (bytes/s
over the bytes of states a token); both are printed and ``ceiling_binds`` says
which. Every rate excludes engine start-up and counts tokens of the data set.

Writes ``gpu.json`` and ``gpu.md`` in ``--results`` (default
benchmarks/results), merged by model. Usage:

    python3 benchmarks/gpu_bench.py --model llama-1b [--samples 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MAX_MODEL_LEN = 2048
BATCH = 32
VOCAB = 32000

# name: (architecture, config overrides, layers captured (speculators 0.3.0 ids))
MODELS: dict[str, tuple[str, dict[str, Any], list[int]]] = {
    "llama-1b": (
        "llama",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
        },
        [2, 8, 14],
    ),
    "llama-8b": (
        "llama",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
        },
        [2, 16, 29],
    ),
    "deepseek-v3-moe": (
        "deepseek_v3",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 12,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "moe_intermediate_size": 1024,
            "n_routed_experts": 32,
            "num_experts_per_tok": 4,
            "n_shared_experts": 1,
            "n_group": 4,
            "topk_group": 2,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "routed_scaling_factor": 2.5,
        },
        [2, 6, 9],
    ),
}
PHASES = ("prefill", "native", "generate", "generate-v1", "extract", "disk")


def log(message: str) -> None:
    print(f"[bench-gpu {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- inputs -----------------------------------------------------------------


def build_model(name: str, path: Path) -> Path:
    """A random-weight bfloat16 checkpoint with specshim's tiny tokenizer."""
    if (path / "config.json").exists():
        return path
    import torch
    import transformers

    from specshim.job.tiny_checkpoints import (
        COMMON,
        build_tokenizer,
        deepseek_v3_config,
    )

    arch, overrides, _ = MODELS[name]
    common = {**COMMON, "vocab_size": VOCAB, "max_position_embeddings": 4096}
    if arch == "llama":
        config = transformers.LlamaConfig(
            **{**common, **overrides}, architectures=["LlamaForCausalLM"]
        )
    else:
        config = transformers.DeepseekV3Config(
            **deepseek_v3_config(**{**common, **overrides})
        )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model_cls = config.architectures[0]
        model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    saved = json.loads((path / "config.json").read_text())
    saved.update(torch_dtype="bfloat16", dtype="bfloat16")
    if arch == "deepseek_v3":  # vLLM's loader reads these to accept the bias
        saved.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    del model
    return path


def build_data(path: Path, samples: int) -> list[list[int]]:
    """Samples of 256 to 1,535 random token ids (seed 0), as extract's JSONL."""
    rng = random.Random(0)
    data = [
        [rng.randrange(300, VOCAB) for _ in range(rng.randint(256, 1535))]
        for _ in range(samples)
    ]
    with path.open("w") as handle:
        for ids in data:
            handle.write(json.dumps({"input_ids": ids}) + "\n")
    return data


# -- the parts, each run in its own process (``--part``) -----------------------


def part_prefill(args: argparse.Namespace, data: list[list[int]]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(**_engine(args))
    return _timed_llm(llm, data, SamplingParams(max_tokens=1, detokenize=False))


def _engine(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's engine as the reference runs it: eager, no prefix caching."""
    return {
        "model": str(args.model_dir),
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "max_model_len": MAX_MODEL_LEN,
        "skip_tokenizer_init": True,
    }


def _timed_llm(llm: Any, data: list[list[int]], params: Any) -> dict[str, Any]:
    prompts = [{"prompt_token_ids": ids} for ids in data]
    llm.generate(prompts[:BATCH], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {"seconds": time.perf_counter() - start, "outputs": outputs}


def part_native(args: argparse.Namespace, data: list[list[int]]) -> dict[str, Any]:
    import fcntl

    from vllm import LLM, SamplingParams

    out = args.work / "native"
    subprocess.run(["rm", "-rf", str(out)], check=True)  # the disk holds one set
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
    timed = _timed_llm(llm, data, params)
    start = time.perf_counter() - timed["seconds"]
    paths = [o.kv_transfer_params["hidden_states_path"] for o in timed["outputs"]]
    for path in paths:  # the writer holds each lock until its file is whole
        with open(path + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes": sum(os.path.getsize(p) for p in paths)}


def part_generate(args: argparse.Namespace, data: list[list[int]]) -> dict[str, Any]:
    import importlib

    import specshim  # noqa: F401  (first: it arms the patches speculators needs)
    from specshim.testing.worker_probes import backends

    generator_cls = importlib.import_module(
        "speculators.data_generation"
    ).VllmHiddenStatesGenerator
    generator = generator_cls(
        str(args.model_dir),
        layer_ids=MODELS[args.model][2],
        max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=0.8,
    )
    batches = [data[i : i + BATCH] for i in range(0, len(data), BATCH)]
    generator.generate(batches[0])  # warm-up
    start = time.perf_counter()
    for batch in batches:
        results = generator.generate(batch)
        del results
    seconds = time.perf_counter() - start
    found = {
        "seconds": seconds,
        "backends": generator.executor.collective_rpc(backends)[0],
    }
    if args.profile:
        found["profile"] = _profiled(generator, batches[: args.profile])
    generator.executor.shutdown()
    return found


def _profiled(generator: Any, batches: list[Any]) -> str:
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for batch in batches:
        generator.generate(batch)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()[-6000:]


def part_extract(args: argparse.Namespace, data: list[list[int]]) -> dict[str, Any]:
    out = args.work / "extract-out"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    layers = ",".join(str(k) for k in MODELS[args.model][2])
    command = [
        sys.executable,
        "-m",
        "specshim",
        "extract",
        "--model",
        str(args.model_dir),
        "--data",
        str(args.work / "data.jsonl"),
        "--out",
        str(out),
        "--layers",
        layers,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--batch-size",
        str(BATCH),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    (args.results / f"extract-{args.model}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"extract exited {done.returncode}: {done.stderr[-800:]}")
    line = [x for x in done.stdout.splitlines() if x.startswith("extract: wrote")][-1]
    rate = float(line.rsplit(" at ", 1)[1].split(" tok/s")[0].replace(",", ""))
    tokens = sum(len(ids) for ids in data)
    size = sum(p.stat().st_size for p in out.glob("data_*.pt"))
    return {"seconds": tokens / rate, "bytes": size, "line": line}


def part_disk(args: argparse.Namespace, data: list[list[int]]) -> dict[str, Any]:
    """bytes/s writing files the size of an average sample's, fsync or not."""
    per_token = _state_bytes_per_token(args)
    size = int(per_token * sum(map(len, data)) / len(data))
    count = max(8, (4 << 30) // size)
    where = args.work / "disk"
    where.mkdir(parents=True, exist_ok=True)
    payload = os.urandom(size)
    found = {"file_bytes": size, "files": count}
    for label, sync in (("nofsync", False), ("fsync", True)):
        start = time.perf_counter()
        for i in range(count):
            with open(where / f"f{i}", "wb") as handle:
                handle.write(payload)
                if sync:
                    handle.flush()
                    os.fsync(handle.fileno())
        found[f"{label}_bytes_per_s"] = size * count / (time.perf_counter() - start)
        for i in range(count):
            os.unlink(where / f"f{i}")
    return found


def _state_bytes_per_token(args: argparse.Namespace) -> int:
    hidden = MODELS[args.model][1]["hidden_size"]
    return len(MODELS[args.model][2]) * hidden * 2  # bfloat16


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
}


def run_part(args: argparse.Namespace) -> None:
    data = [json.loads(line)["input_ids"] for line in (args.work / "data.jsonl").open()]
    found = PARTS[args.part](args, data)
    found.pop("outputs", None)
    print("BENCH " + json.dumps(found), flush=True)


# -- the driver ---------------------------------------------------------------


def spawn(args: argparse.Namespace, part: str) -> dict[str, Any]:
    env = dict(os.environ)
    if part in ("native", "generate-v1"):
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # native extraction is V1-only
    command = [
        sys.executable,
        __file__,
        "--part",
        part,
        "--model",
        args.model,
        "--work",
        str(args.work),
        "--results",
        str(args.results),
        "--profile",
        str(args.profile),
    ]
    log(f"{part}: start")
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=args.part_timeout
        )
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() + (exc.stderr or b"").decode()
        (args.results / f"{part}-{args.model}.log").write_text(text)
        log(f"{part}: killed after {args.part_timeout} s")
        return {"error": f"timed out after {args.part_timeout} s"}
    (args.results / f"{part}-{args.model}.log").write_text(done.stdout + done.stderr)
    lines = [x for x in done.stdout.splitlines() if x.startswith("BENCH ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        log(f"{part}: FAILED ({done.returncode}): {' | '.join(tail)}")
        return {"error": " | ".join(tail)[-600:]}
    found = json.loads(lines[-1][6:])
    log(f"{part}: done in {time.perf_counter() - started:.0f} s")
    return found


def summarise(args: argparse.Namespace, parts: dict[str, Any], tokens: int) -> dict:
    per_token = _state_bytes_per_token(args)
    rate = {
        name: tokens / found["seconds"]
        for name, found in parts.items()
        if "seconds" in found
    }
    disk = parts.get("disk", {})
    disk_rate = disk.get("nofsync_bytes_per_s")
    prefill = rate.get("prefill")
    ceiling = binds = None
    if prefill and disk_rate:
        disk_tokens = disk_rate / per_token
        ceiling, binds = min((prefill, "prefill"), (disk_tokens, "disk"))

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 4) if a and b else None

    return {
        "model": args.model,
        "tokens": tokens,
        "state_bytes_per_token": per_token,
        "tok_per_s": {k: round(v) for k, v in rate.items()},
        "disk": disk,
        "disk_tok_per_s": {
            k: round(disk[f"{k}_bytes_per_s"] / per_token)
            for k in ("nofsync", "fsync")
            if f"{k}_bytes_per_s" in disk
        },
        "ceiling_tok_per_s": round(ceiling) if ceiling else None,
        "ceiling_binds": binds,
        "extract_vs_ceiling": ratio(rate.get("extract"), ceiling),
        "generate_vs_prefill": ratio(rate.get("generate"), prefill),
        "generate_v1_vs_prefill": ratio(rate.get("generate-v1"), prefill),
        "extract_vs_native": ratio(rate.get("extract"), rate.get("native")),
        "extract_vs_generate": ratio(rate.get("extract"), rate.get("generate")),
        "native_vs_prefill": ratio(rate.get("native"), prefill),
        "errors": {k: v["error"] for k, v in parts.items() if "error" in v},
        "backends": parts.get("generate", {}).get("backends"),
        "stack": _stack(),
        "date": time.strftime("%Y-%m-%d"),
    }


def _stack() -> dict[str, str]:
    import importlib.metadata as md

    found = {}
    for name in ("vllm", "torch", "transformers", "speculators", "specshim"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = "absent"
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        gpu = "unknown"
    found["gpu"] = gpu
    return found


def write_results(results: Path, summary: dict[str, Any]) -> None:
    path = results / "gpu.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged[summary["model"]] = summary
    path.write_text(json.dumps(merged, indent=2) + "\n")
    (results / "gpu.md").write_text(render(merged))


def render(merged: dict[str, Any]) -> str:
    rows = [
        "| model | prefill | native | generate (vLLM's runner) | generate (V1) | "
        "extract | disk, no fsync / fsync | ceiling (binds) | extract / ceiling | "
        "generate / prefill | extract / native |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in merged.items():
        r, d = s["tok_per_s"], s["disk_tok_per_s"]

        def f(v: Any) -> str:
            return f"{v:,}" if isinstance(v, int) else ("—" if v is None else str(v))

        rows.append(
            f"| {name} | {f(r.get('prefill'))} | {f(r.get('native'))} | "
            f"{f(r.get('generate'))} | {f(r.get('generate-v1'))} | "
            f"{f(r.get('extract'))} | {f(d.get('nofsync'))} / {f(d.get('fsync'))} | "
            f"{f(s['ceiling_tok_per_s'])} ({s['ceiling_binds']}) | "
            f"{f(s['extract_vs_ceiling'])} | {f(s['generate_vs_prefill'])} | "
            f"{f(s['extract_vs_native'])} |"
        )
    for name, s in merged.items():
        if s.get("sources"):
            parts = ", ".join(f"{k}: {v}" for k, v in s["sources"].items())
            rows.append(f"\n{name}'s figures came from these runs: {parts}.")
    first = next(iter(merged.values()))
    stack = ", ".join(f"{k} {v}" for k, v in first["stack"].items())
    return (
        "# make bench-gpu\n\nTokens per second of the same data set (start-up "
        "excluded); disk figures are tokens' worth of states per second.\n\n"
        + "\n".join(rows)
        + f"\n\nStack: {stack}; {first['date']}.\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-1b")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--work", type=Path, default=Path("/tmp/specshim-bench-gpu"))
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--parts", default=",".join(PHASES))
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="after the timed run, profile this many batches of generate()",
    )
    parser.add_argument("--part-timeout", type=int, default=300)
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model_dir = args.work / args.model
    if args.part:
        run_part(args)
        return 0
    try:
        import torch
    except ImportError:
        print(
            "bench-gpu: torch is not installed for this Python; run it where "
            "vLLM's CUDA build is (make test-gpu builds .venv-gpu)"
        )
        return 2
    if not torch.cuda.is_available():
        print("bench-gpu: no CUDA device here; run it on a host with an NVIDIA GPU")
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    args.results.mkdir(parents=True, exist_ok=True)
    log(f"{args.model}: building the checkpoint and {args.samples} samples")
    tokens = sum(map(len, build_data(args.work / "data.jsonl", args.samples)))
    if "error" in spawn(args, "build"):
        return 1
    parts = {}
    for part in args.parts.split(","):
        if part == "native" and MODELS[args.model][0] == "deepseek_v3":
            parts[part] = {"error": "vLLM's native extraction refuses MLA models"}
            continue
        parts[part] = spawn(args, part)
    summary = summarise(args, parts, tokens)
    write_results(args.results, summary)
    print(json.dumps({k: summary[k] for k in list(summary)[:14]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
