"""``make bench-gpu``: specshim against vLLM's own speed, on one NVIDIA GPU.

For one model (``--model``, see gpu_models.py), on the same data in the same
run, each part in a process of its own (gpu_parts.py says what each times):

* ``prefill``: vLLM's own ``LLM.generate(max_tokens=1)`` over every sample,
  eager, no prefix caching, vLLM's runner choice; specshim not imported.
* ``native``: vLLM's native extraction (``extract_hidden_states`` with
  ``ExampleHiddenStatesConnector``, V1 runner, same layers), each pass timed
  until every file is written. vLLM refuses MLA models: those have no peer.
* ``generate`` (and ``generate-v1``, the V1 runner forced): speculators
  0.3.0's ``generate()`` with specshim, batches of 32, no files written.
* ``extract``: ``specshim extract`` end to end (files, manifest and all), its
  own rate from the first ``generate()``, and where its time went.
* ``disk``: what the output disk takes in files the size of an average
  sample: into the page cache with 1 to 16 threads, and with an fsync each.
* ``reuse`` (named only, not among the default parts): issue 47's three data
  sets through ``extract --reuse-prefixes`` against ``extract``
  (reuse_bench.py, one run a side).
* ``reuse-calls`` (named only): the library path's ``generate()`` calls over
  the ``system`` data set with the prefix cache off and on, each call's time,
  its engine steps and tokens, and profiles of a few (gpu_reuse_calls.py).

The peer at its best: prefill and native are each the best of 2 timed passes
after a warm-up, run at vLLM's default ``gpu_memory_utilization`` and at
extract's (0.8); the faster counts, and the results name the settings.
Ratios are against them; gpu_summary.py holds issue 45's targets.

Writes ``gpu.json`` and ``gpu.md`` in ``--results`` (default
benchmarks/results), merged by model. Usage:

    python3 benchmarks/gpu_bench.py --model llama-1b [--samples 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_models import MODELS, SAMPLES, build_data
from gpu_parts import EXTRACT_UTILIZATION, PART_TIMEOUTS, PARTS, label
from gpu_summary import summarise, write_results

HERE = Path(__file__).resolve().parent
PHASES = ("prefill", "native", "generate", "extract", "disk")
PEERS = ("prefill", "native")  # run at both utilizations


def log(message: str) -> None:
    print(f"[bench-gpu {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_part(args: argparse.Namespace) -> None:
    data = [json.loads(line)["input_ids"] for line in (args.work / "data.jsonl").open()]
    found = PARTS[args.part](args, data)
    print("BENCH " + json.dumps(found), flush=True)


def spawn(args: argparse.Namespace, part: str, **options: Any) -> dict[str, Any]:
    """Run one part in a process of its own; its BENCH line, or its error."""
    env = dict(os.environ)
    if part in ("native", "generate-v1"):
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # native extraction is V1-only
    name = label(part, **options)
    command = [
        *(sys.executable, __file__, "--part", part, "--model", args.model),
        *("--work", str(args.work), "--results", str(args.results)),
        *("--profile", str(args.profile)),
        *("--worker-profile", str(args.worker_profile)),
        *(f"--{k}={v}" for k, v in options.items()),
    ]
    log(f"{name}: start")
    started = time.perf_counter()
    log_path = args.results / f"{name}-{args.model}.log"
    limit = max(args.part_timeout, PART_TIMEOUTS.get(part, 0))
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=limit
        )
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() + (exc.stderr or b"").decode()
        log_path.write_text(text)
        log(f"{name}: killed after {limit} s")
        return {"error": f"timed out after {limit} s"}
    log_path.write_text(done.stdout + done.stderr)
    lines = [x for x in done.stdout.splitlines() if x.startswith("BENCH ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        log(f"{name}: FAILED ({done.returncode}): {' | '.join(tail)}")
        return {"error": " | ".join(tail)[-600:]}
    found = json.loads(lines[-1][6:])
    log(f"{name}: done in {time.perf_counter() - started:.0f} s")
    return found


def calls_line(found: dict[str, Any]) -> str:
    """reuse-calls' figures in one line of the output (the logs may not come
    back from a lent host)."""
    if "error" in found:
        return found["error"]
    worker = found.get("worker_profile", {})
    return (
        f"median {found['median_after_first_s']} s a call (calls {found['calls_s']}); "
        f"steps a call {found['steps_per_call']}; tokens a step "
        f"{found['tokens_per_step'][-2:]}; profiled {worker.get('calls')} calls "
        f"{worker.get('wall_s')} s, GPU busy {worker.get('device_us')} us, "
        f"copies {worker.get('copies_us')}"
    )


def run_parts(args: argparse.Namespace) -> dict[str, Any]:
    """The parts named by ``--parts``, added to what earlier runs of this
    model on this checkpoint and data found (a lent host's calls are 10
    minutes each: a model's parts can span calls)."""
    kept = args.work / f"parts-{args.model}.json"
    parts: dict[str, Any] = json.loads(kept.read_text()) if kept.exists() else {}
    for part in args.parts.split(","):
        if part == "native" and MODELS[args.model][0] == "deepseek_v3":
            parts[part] = {"error": "vLLM's native extraction refuses MLA models"}
            continue
        if part == "reuse-calls":  # the library path's calls, cache off and on
            for reuse in ("0", "1"):
                found = parts[label(part, reuse=reuse)] = spawn(args, part, reuse=reuse)
                log(f"{label(part, reuse=reuse)}: {calls_line(found)}")
            continue
        if part in PEERS:
            for util in ("default", str(EXTRACT_UTILIZATION)):
                parts[label(part, util=util)] = spawn(args, part, util=util)
        elif part in ("generate", "extract") and args.budgets:
            parts[part] = spawn(args, part)
            for budget in args.budgets.split(","):
                parts[label(part, budget=budget)] = spawn(args, part, budget=budget)
        else:
            parts[part] = spawn(args, part)
        if part in ("generate", "extract") and args.batch_sizes:
            for size in args.batch_sizes.split(","):
                parts[label(part, batch=size)] = spawn(args, part, batch=size)
        if part == "generate" and args.hold:
            parts[label(part, hold=args.hold)] = spawn(args, part, hold=args.hold)
        if part == "extract" and args.writer_threads:
            for threads in args.writer_threads.split(","):
                parts[label(part, threads=threads)] = spawn(args, part, threads=threads)
        kept.write_text(json.dumps(parts))
    return parts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-1b")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--work", type=Path, default=Path("/tmp/specshim-bench-gpu"))
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--parts", default=",".join(PHASES))
    parser.add_argument(
        "--budgets",
        default="",
        help="also run generate and extract at these tokens a step (extract's "
        "--max-batched-tokens; comma-separated)",
    )
    parser.add_argument(
        "--writer-threads",
        default="",
        help="also run extract with its writer's pool at these sizes "
        "(SPECSHIM_WRITER_THREADS; comma-separated)",
    )
    parser.add_argument(
        "--batch-sizes",
        default="",
        help="also run generate and extract with these many sequences a "
        "generate() call (extract's --batch-size; comma-separated)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="after the timed run, profile this many batches of generate(); "
        "for --parts reuse, any number: one more run with the flag a data set "
        "under cProfile",
    )
    parser.add_argument(
        "--worker-profile",
        type=int,
        default=0,
        help="after the timed run, this many batches of generate() under "
        "torch's profiler in the worker (GPU busy time, copies)",
    )
    parser.add_argument(
        "--hold",
        type=int,
        default=0,
        help="also run generate keeping the last N calls' results alive, as "
        "extract's writer does (about 3): is extract's generate() slower for "
        "the memory it holds, or for the writer's work beside it?",
    )
    parser.add_argument("--part-timeout", type=int, default=300)
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--util", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--reuse", type=int, default=0, help=argparse.SUPPRESS)
    return parser


def main() -> int:
    args = _parser().parse_args()
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
    samples = args.samples or SAMPLES.get(args.model, 1024)
    log(f"{args.model}: building the checkpoint and {samples} samples")
    data = args.work / "data.jsonl"
    before = data.read_bytes() if data.exists() else b""
    tokens = sum(map(len, build_data(data, samples)))
    if data.read_bytes() != before or not args.model_dir.exists():
        (args.work / f"parts-{args.model}.json").unlink(missing_ok=True)
    if "error" in spawn(args, "build"):
        return 1
    summary = summarise(args.model, run_parts(args), tokens)
    write_results(args.results, summary)
    keys = ("tok_per_s", "prefill", "native", "extract_vs_native")
    keys += ("extract_vs_prefill", "generate_vs_prefill", "extract_vs_generate")
    keys += ("extract_timing", "targets", "errors")
    print(json.dumps({k: summary[k] for k in keys}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
