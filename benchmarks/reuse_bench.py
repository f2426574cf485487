"""``make bench-reuse`` (part of ``make bench``): ``extract --reuse-prefixes``
against ``extract`` without it, on three data sets, in one run.

Issue 47's data sets (token ids, seed 0, the vocabulary's first 1,000 ids
at most):

* ``system``: a 1,024-token system prompt shared by every sample, then a
  tail of U[128, 1,023] tokens. Goal: >= 1.6x the samples/s.
* ``responses``: 4 responses of U[128, 512] tokens to each 512-token prompt.
  Goal: >= 1.3x.
* ``unshared``: U[256, 1,536] tokens, nothing shared. Goal: >= 0.97x
  (reading the shard first, and finding that no two samples share a first
  block, cost almost nothing; the cache then stays off).

Each data set runs in blocks of without, with, with, without (each run a
process of its own), and each side's median counts. A run's rate is
``extract``'s own: from the engine's start (with the flag: before the plan is
made, so planning counts) to the last file committed. Both runs' files are
compared before they are removed: the reused run must write the same samples,
each within the reference tolerance of the run without (``verify``'s bar
against HF); how many are bit-identical is reported.

On CPU the tiny DeepSeek-V3 of ``make bench`` (layers 2, 4, 7); on a GPU host
``--model-dir`` names the checkpoint (``make bench-gpu`` builds them under
/tmp/specshim-bench-gpu) and ``--layers`` its captured layers.

Writes ``RESULTS/reuse.json`` and ``reuse.md`` (``--results``, default
benchmarks/results; ``--name`` names the files on a GPU host).

Usage: .venv/bin/python benchmarks/reuse_bench.py [--samples 96] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan import HERE, LAYERS, RUN_ENV, extract_timing, timing_sentence  # noqa: E402

MAX_MODEL_LEN = 2048
BATCH = 32
GOALS = {"system": 1.6, "responses": 1.3, "unshared": 0.97}
VOCAB = 1000  # at most: the model's own vocabulary bounds it


def dataset(kind: str, samples: int, vocab: int = VOCAB) -> list[list[int]]:
    """``samples`` sequences of the named data set (seed 0), token ids below
    ``vocab``."""
    rng = random.Random(0)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(count)]

    if kind == "system":
        prompt = tokens(1024)
        return [prompt + tokens(rng.randint(128, 1023)) for _ in range(samples)]
    if kind == "responses":
        seqs: list[list[int]] = []
        while len(seqs) < samples:
            prompt = tokens(512)
            seqs += [prompt + tokens(rng.randint(128, 512)) for _ in range(4)]
        return seqs[:samples]
    if kind == "unshared":
        return [tokens(rng.randint(256, 1536)) for _ in range(samples)]
    raise ValueError(kind)


def _env(cpu: bool) -> dict[str, str]:
    """make bench's CPU settings (no MLA kernel there); a GPU host runs as is."""
    return {**os.environ, **(RUN_ENV if cpu else {}), "PYTHONUNBUFFERED": "1"}


def run(
    args: argparse.Namespace,
    data: Path,
    out: Path,
    reuse: bool,
    profile: Path | None = None,
    worker: int = 0,
) -> dict[str, Any]:
    """One ``extract`` process: its rate, samples/s, what reuse served and
    where its time went (``profile``: under cProfile, the stats written
    there; ``worker``: that many calls from the second on under the worker's
    profiler, ``profiled_extract.py``'s line and table in ``worker``)."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable]
    command += ["-m", "cProfile", "-o", str(profile)] if profile else []
    into = out.with_name(out.name + ".worker.txt")  # profiled_extract's file
    into.unlink(missing_ok=True)
    if worker:
        command += [str(HERE / "profiled_extract.py"), "2", str(worker), str(into)]
        command += ["extract"]
    else:
        command += ["-m", "specshim", "extract"]
    command += ["--model", str(args.model_dir), "--data", str(data)]
    command += ["--out", str(out), "--layers", args.layers]
    command += ["--max-model-len", str(MAX_MODEL_LEN), "--batch-size", str(BATCH)]
    command += ["--reuse-prefixes"] if reuse else []
    done = subprocess.run(command, capture_output=True, text=True, env=_env(args.cpu))
    if done.returncode:
        raise SystemExit(f"extract failed:\n{done.stderr[-3000:]}")
    line = [x for x in done.stdout.splitlines() if x.startswith("extract: wrote")][-1]
    rate = float(line.rsplit(" at ", 1)[1].split(" tok/s")[0].replace(",", ""))
    samples = sum(1 for _ in data.open())
    tokens = sum(len(json.loads(x)["input_ids"]) for x in data.open())
    found: dict[str, Any] = {
        "reuse": reuse,
        "tokens_per_second": rate,
        "samples_per_second": rate * samples / tokens,
        "line": line,
    }
    served = re.search(r"prefix reuse served (\d+) of (\d+) tokens", done.stderr)
    if served:
        found["served_tokens"] = int(served.group(1))
    if "the prefix cache stays off" in done.stderr:
        found["cache_off"] = True  # nothing could be shared
    copying = re.search(
        r"prefix reuse: (the main process put served rows .*)", done.stderr
    )
    if copying:  # the stitching's seconds, bytes and page faults
        found["copying"] = copying.group(1)
    timing = extract_timing(done.stderr)
    if timing:
        found["timing"] = timing
    if worker:  # none where the run made fewer than worker + 1 calls
        found["worker"] = into.read_text() if into.exists() else "no calls profiled"
    return found


def where(found: dict[str, Any]) -> str:
    """A run's time, as extract's closing line splits it."""
    timing = found.get("timing")
    return timing_sentence("extract", timing) if timing else "no timing line"


def profiled(args: argparse.Namespace, kind: str, data: Path, work: Path) -> None:
    """One more run with the flag, under cProfile: the main process's 30
    costliest functions by their own time (waiting on the engine's queue
    among them, as it is the pace the GPU sets), then specshim's patches and
    extract and speculators' generator by cumulative time, into
    ``RESULTS/NAME-KIND.profile.txt``."""
    import pstats

    stats = work / f"{kind}.prof"
    found = run(args, data, work / "out-profile", True, profile=stats)
    shutil.rmtree(work / "out-profile", ignore_errors=True)
    text = args.results / f"{args.name}-{kind}.profile.txt"
    with text.open("w") as sink:
        copying = found.get("copying", "")
        sink.write(f"{found['line']}\n{where(found)}\n{copying}\n\n")
        pstats.Stats(str(stats), stream=sink).sort_stats("tottime").print_stats(30)
        # Start-up dominates the above; what the calls themselves cost:
        sink.write("\nspecshim's and speculators' own functions, by cumulative time:\n")
        cumulative = pstats.Stats(str(stats), stream=sink).sort_stats("cumulative")
        ours = r"specshim/(patches|job/extract)|speculators/data_gen"
        cumulative.print_stats(ours, 40)
    log(f"{kind}: the main process's profile of a run with the flag: {text}")


def worker_profiled(args: argparse.Namespace, kind: str, data: Path, work: Path):
    """Two more runs, without the flag and with it, each with the worker's
    profile of ``--worker-profile`` calls from the second on, into
    ``RESULTS/NAME-KIND.worker.txt``: what the worker does in a call inside
    ``extract``, reused or not."""
    text = args.results / f"{args.name}-{kind}.worker.txt"
    with text.open("w") as sink:
        for reuse in (False, True):
            out = work / "out-worker"
            found = run(args, data, out, reuse, worker=args.worker_profile)
            shutil.rmtree(out, ignore_errors=True)
            sink.write(f"reuse={reuse}: {found['line']}\n{where(found)}\n")
            sink.write(f"{found['worker']}\n")
    log(f"{kind}: the worker's profile of calls in each run: {text}")


def compare(plain: Path, reused: Path, samples: int) -> dict[str, Any]:
    """Every sample of the reused run against the plain run's, by the bar
    ``verify`` holds captures to against HF (``mismatch``: per-token cosine
    and norm ratio, a small share of tokens allowed under it, as an MoE's
    routing may flip on bf16 noise); the lowest per-token cosine, and how
    many files are bit-identical."""
    import torch

    from specshim.job.verify.hf_reference import mismatch

    lowest, identical = 1.0, 0
    for i in range(samples):
        a = torch.load(plain / f"data_{i}.pt", weights_only=True)
        b = torch.load(reused / f"data_{i}.pt", weights_only=True)
        if not torch.equal(a["input_ids"], b["input_ids"]):
            raise SystemExit(f"sample {i}: the runs wrote different input_ids")
        sizes = [(x / f"data_{i}.pt").stat().st_size for x in (plain, reused)]
        if abs(sizes[0] - sizes[1]) >= 1024:  # the archive's folder name may differ
            raise SystemExit(f"sample {i}: files of {sizes[0]} and {sizes[1]} bytes")
        why = mismatch(b["hidden_states"], a["hidden_states"])
        if why:
            raise SystemExit(f"sample {i}: the reused run's rows differ: {why}")
        pairs = list(zip(a["hidden_states"], b["hidden_states"], strict=True))
        identical += all(torch.equal(x, y) for x, y in pairs)
        for x, y in pairs:
            cos = torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1)
            lowest = min(lowest, cos.min().item())
    return {"lowest_token_cosine": lowest, "identical": identical}


def measure(args: argparse.Namespace, kind: str, work: Path) -> dict[str, Any]:
    """Blocks of without, with, with, without on one data set."""
    config = json.loads((args.model_dir / "config.json").read_text())
    seqs = dataset(kind, args.samples, min(VOCAB, config.get("vocab_size", VOCAB)))
    data = work / f"{kind}.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    agreement: dict[str, Any] = {}
    for block in range(args.rounds):
        for reuse in [side == "B" for side in args.order]:
            out = work / f"out-{int(reuse)}"
            found = run(args, data, out, reuse)
            runs[reuse].append(found)
            log(f"{kind} {block + 1}/{args.rounds} reuse={reuse}: {found['line']}")
            log(f"{kind} {block + 1}/{args.rounds} reuse={reuse}: {where(found)}")
            if "copying" in found:
                log(f"{kind} {block + 1}/{args.rounds}: {found['copying']}")
        if block == 0:  # each side's last files of the block
            agreement = compare(work / "out-0", work / "out-1", len(seqs))
    for reuse in (False, True):
        shutil.rmtree(work / f"out-{int(reuse)}", ignore_errors=True)
    if args.profile:
        profiled(args, kind, data, work)
    if args.worker_profile:
        worker_profiled(args, kind, data, work)
    without = statistics.median(r["samples_per_second"] for r in runs[False])
    with_ = statistics.median(r["samples_per_second"] for r in runs[True])
    return {
        "samples": len(seqs),
        "tokens": sum(map(len, seqs)),
        "without": runs[False],
        "with": runs[True],
        "samples_per_second": {"without": without, "with": with_},
        "speedup": with_ / without,
        "goal": GOALS[kind],
        "met": with_ / without >= GOALS[kind],
        "agreement": agreement,
    }


def log(message: str) -> None:
    print(f"[bench-reuse] {message}", flush=True)


def markdown(results: dict[str, Any]) -> str:
    """``reuse.md`` (without its final line break), from ``reuse.json``."""
    lines = [
        f"`extract --reuse-prefixes` against `extract` ({results['model']}, "
        f"{results['machine']}; median of {results['runs_a_side']} run(s) a side, "
        "samples/s from extract's own rate)",
        "",
        "| data set | samples | tokens | served from cache | without | with | "
        "speedup | goal | bit-identical files |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, row in results["datasets"].items():
        served = statistics.median(r.get("served_tokens", 0) for r in row["with"])
        off = all(r.get("cache_off") for r in row["with"])
        rate = row["samples_per_second"]
        lines.append(
            f"| {kind} | {row['samples']} | {row['tokens']:,} | "
            f"{served / row['tokens']:.0%}{' (cache off)' if off else ''} | "
            f"{rate['without']:.2f} | "
            f"{rate['with']:.2f} | **{row['speedup']:.2f}x** | "
            f">= {row['goal']}x ({'met' if row['met'] else 'NOT met'}) | "
            f"{row['agreement'].get('identical', 0)} of {row['samples']} |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=1, help="blocks of runs")
    parser.add_argument(
        "--order",
        default="ABBA",
        choices=("ABBA", "AB", "BA"),
        help="a block's runs, A without the flag and B with it (AB or BA: one "
        "each, where engine starts are dear; BA puts a fresh host's first-run "
        "cost on the flag's side)",
    )
    parser.add_argument("--datasets", default=",".join(GOALS))
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--layers", default=",".join(map(str, LAYERS)))
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--name", default="reuse")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after each data set's runs, one more with the flag under cProfile "
        "(RESULTS/NAME-KIND.profile.txt)",
    )
    parser.add_argument(
        "--worker-profile",
        type=int,
        default=0,
        metavar="N",
        help="after each data set's runs, one more a side with the worker's "
        "profile of N calls from the second on (RESULTS/NAME-KIND.worker.txt)",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    args.cpu = args.model_dir is None
    if args.cpu:
        from execute import ensure_models

        args.model_dir = ensure_models()["deepseek_v3"]
        model = "tiny DeepSeek-V3 (make bench's)"
    else:
        model = args.model_dir.name
    args.results.mkdir(parents=True, exist_ok=True)  # --profile writes there first
    work = Path(tempfile.mkdtemp(prefix="bench-reuse-"))
    try:
        found = {k: measure(args, k, work) for k in args.datasets.split(",")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {
        "model": model,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "rounds": args.rounds,
        "runs_a_side": args.rounds * len(args.order) // 2,
        "datasets": found,
    }
    path = args.results / f"{args.name}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    text = markdown(results)
    path.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
