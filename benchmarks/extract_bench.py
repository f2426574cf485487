"""``make bench-extract``: what the streaming ``extract`` costs, and what it holds.

On the tiny DeepSeek-V3 of ``make bench`` (layers [2, 4, 7], max-model-len 2048,
batches of 32, extract's step budget, a 4 GiB CPU KV cache):

1. **Throughput.** 2,000 samples of U[64, 1024] token ids (seed 0). ``specshim
   extract`` end to end against bare ``generate()`` over the same batches in
   the same order, each in its own process, interleaved A B B A. Both rates
   count from the first ``generate()`` call (model loading excluded) to the last
   result (extract: to the last file written). Goal: extract >= 0.95x bare.
2. **Streaming.** ``extract`` on 10,000- and 200,000-line datasets of ``text``
   (the tokenizer runs: one token per byte, U[64, 1024] characters), stopped
   after its third ``generate()``: seconds from the call of ``extract()`` to the
   first ``generate()``, and the main process's peak RSS by then. Goal: both
   within 10% between the two datasets.

Writes ``benchmarks/results/extract.json`` and ``extract.md``.

Usage: .venv/bin/python benchmarks/extract_bench.py [--samples 2000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from execute import ensure_models, log  # noqa: E402
from plan import CACHE, HERE, LAYERS, RUN_ENV  # noqa: E402

RESULTS = HERE / "results"
BATCH = 32
MAX_MODEL_LEN = 2048
STOP_AFTER = 3  # generate() calls in the streaming measurement
GOAL_RATIO = 0.95
GOAL_SPREAD = 0.10


def token_dataset(path: Path, count: int) -> Path:
    rng = random.Random(0)
    with path.open("w") as handle:
        for _ in range(count):
            ids = [rng.randrange(256) for _ in range(rng.randint(64, 1024))]
            handle.write(json.dumps({"input_ids": ids}) + "\n")
    return path


def text_dataset(path: Path, count: int) -> Path:
    if path.exists():
        return path
    rng = random.Random(1)
    words = [
        "".join(rng.choices("abcdefghij", k=rng.randint(2, 9))) for _ in range(500)
    ]
    with path.open("w") as handle:
        for _ in range(count):
            length = rng.randint(64, 1024)
            text = ""
            while len(text) < length:
                text += rng.choice(words) + " "
            handle.write(json.dumps({"text": text[:length]}) + "\n")
    return path


def _env() -> dict[str, str]:
    return {**os.environ, **RUN_ENV, "PYTHONUNBUFFERED": "1"}


def run_extract(model: Path, data: Path, out: Path) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "specshim", "extract", "--model", str(model)]
    cmd += ["--data", str(data), "--out", str(out), "--batch-size", str(BATCH)]
    cmd += ["--layers", ",".join(map(str, LAYERS))]
    cmd += ["--max-model-len", str(MAX_MODEL_LEN)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if done.returncode:
        raise SystemExit(f"extract failed:\n{done.stderr[-3000:]}")
    line = done.stdout.strip()
    tokens = int(line.split(" tokens at ")[0].rsplit(" ", 1)[1].replace(",", ""))
    rate = float(line.split(" tokens at ")[1].split(" tok/s")[0].replace(",", ""))
    shutil.rmtree(out, ignore_errors=True)
    return {"tokens": tokens, "tokens_per_second": rate, "line": line}


def run_bare(model: Path, data: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child-bare", str(model), str(data)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if done.returncode:
        raise SystemExit(f"bare generate failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_bare(model: str, data: str) -> None:
    """The same batches through the generator alone, with extract's budget."""
    from speculators.data_generation import VllmHiddenStatesGenerator

    import specshim
    from specshim._settings import STEP_DEFAULTS

    specshim.configure(**STEP_DEFAULTS)
    with open(data) as handle:
        seqs = [json.loads(line)["input_ids"] for line in handle]
    generator = VllmHiddenStatesGenerator(
        model, layer_ids=list(LAYERS), max_model_len=MAX_MODEL_LEN
    )
    started = time.monotonic()
    for start in range(0, len(seqs), BATCH):
        generator.generate(seqs[start : start + BATCH])
    seconds = time.monotonic() - started
    generator.executor.shutdown()
    tokens = sum(map(len, seqs))
    print(json.dumps({"tokens": tokens, "tokens_per_second": tokens / seconds}))


class _StopError(Exception):
    pass


def run_streaming(model: Path, data: Path, out: Path) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, __file__, "--child-stream", str(model), str(data), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    shutil.rmtree(out, ignore_errors=True)
    if done.returncode:
        raise SystemExit(f"streaming run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_stream(model: str, data: str, out: str) -> None:
    """extract() until its third generate(): when the first came, peak RSS."""
    from specshim.job.extract import command as _extract

    seen: dict[str, Any] = {"calls": 0}
    original = _extract._generate

    def watched(generator: Any, batch: Any, writer: Any) -> Any:
        seen["calls"] += 1
        if seen["calls"] == 1:
            seen["first"] = time.monotonic() - began
        if seen["calls"] > STOP_AFTER:
            seen["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            raise _StopError
        return original(generator, batch, writer)

    _extract._generate = watched
    options = _extract.ExtractOptions(
        model=Path(model),
        data=Path(data),
        out=Path(out),
        layers=list(LAYERS),
        max_model_len=MAX_MODEL_LEN,
        batch_size=BATCH,
        progress=False,
    )
    began = time.monotonic()
    try:
        _extract.extract(options)
    except _StopError:
        pass
    print(
        json.dumps(
            {
                "first_generate_seconds": seen["first"],
                "peak_rss_mib": seen["rss"] / 1024,
                "dataset_mib": Path(data).stat().st_size / (1 << 20),
            }
        )
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2, help="A B B A blocks")
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--large", type=int, default=200_000)
    parser.add_argument("--child-bare", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--child-stream", nargs=3, help=argparse.SUPPRESS)
    return parser.parse_args()


def throughput_blocks(
    model: Path, data: Path, work: Path, rounds: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``rounds`` blocks of extract, bare, bare, extract: each kind's runs."""
    extract_runs, bare_runs = [], []
    for block in range(rounds):
        for kind in ("extract", "bare", "bare", "extract"):
            log(f"throughput block {block + 1}/{rounds}: {kind}")
            if kind == "extract":
                extract_runs.append(run_extract(model, data, work / "out"))
                rate = extract_runs[-1]["tokens_per_second"]
            else:
                bare_runs.append(run_bare(model, data))
                rate = bare_runs[-1]["tokens_per_second"]
            log(f"  {rate:,.0f} tok/s")
    return extract_runs, bare_runs


def streaming_runs(model: Path, work: Path, small: int, large: int) -> dict[str, Any]:
    """Time to first generate and peak RSS on a small and a large text file."""
    streaming = {}
    for name, count in (("small", small), ("large", large)):
        text = text_dataset(CACHE / f"text-{count}.jsonl", count)
        log(f"streaming: {count:,} lines of text")
        streaming[name] = {"lines": count, **run_streaming(model, text, work / "o")}
        log(f"  {streaming[name]}")
    return streaming


def judged(
    samples: int,
    extract_runs: list[dict[str, Any]],
    bare_runs: list[dict[str, Any]],
    streaming: dict[str, Any],
) -> dict[str, Any]:
    """The runs, their medians and ratios, and which goals they meet."""
    extract_rate = statistics.median(r["tokens_per_second"] for r in extract_runs)
    bare_rate = statistics.median(r["tokens_per_second"] for r in bare_runs)
    ratio = extract_rate / bare_rate
    small, large = streaming["small"], streaming["large"]
    first = large["first_generate_seconds"] / small["first_generate_seconds"]
    rss = large["peak_rss_mib"] / small["peak_rss_mib"]
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "samples": samples,
        "extract_runs": extract_runs,
        "bare_runs": bare_runs,
        "extract_tokens_per_second": extract_rate,
        "bare_tokens_per_second": bare_rate,
        "ratio": ratio,
        "streaming": streaming,
        "first_generate_large_over_small": first,
        "peak_rss_large_over_small": rss,
        "goals": {
            "extract >= 0.95x bare generate": ratio >= GOAL_RATIO,
            "time to first generate within 10%": abs(first - 1) <= GOAL_SPREAD,
            "peak RSS within 10%": abs(rss - 1) <= GOAL_SPREAD,
        },
    }


def main() -> int:
    args = parse_args()
    if args.child_bare:
        child_bare(*args.child_bare)
        return 0
    if args.child_stream:
        child_stream(*args.child_stream)
        return 0

    model = ensure_models()["deepseek_v3"]
    CACHE.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-extract-"))
    try:
        data = token_dataset(work / "tokens.jsonl", args.samples)
        extract_runs, bare_runs = throughput_blocks(model, data, work, args.rounds)
        streaming = streaming_runs(model, work, args.small, args.large)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    results = judged(args.samples, extract_runs, bare_runs, streaming)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "extract.json").write_text(json.dumps(results, indent=2) + "\n")
    text = markdown(results)
    (RESULTS / "extract.md").write_text(text + "\n")
    print(text)
    return 0


def markdown(results: dict[str, Any]) -> str:
    """``extract.md`` (without its final line break), from ``extract.json``."""
    lines = [
        "| measurement | value |",
        "|---|---|",
        f"| extract, median of {len(results['extract_runs'])} runs | "
        f"{results['extract_tokens_per_second']:,.0f} tok/s |",
        f"| bare generate(), median of {len(results['bare_runs'])} | "
        f"{results['bare_tokens_per_second']:,.0f} tok/s |",
        f"| extract / bare | **{results['ratio']:.3f}x** |",
    ]
    for name in ("small", "large"):
        row = results["streaming"][name]
        lines.append(
            f"| {row['lines']:,} lines ({row['dataset_mib']:,.0f} MiB): first "
            f"generate() after | {row['first_generate_seconds']:.1f} s, peak RSS "
            f"{row['peak_rss_mib']:,.0f} MiB |"
        )
    first = results["first_generate_large_over_small"]
    rss = results["peak_rss_large_over_small"]
    lines.append(f"| large / small: first generate(), RSS | {first:.3f}, {rss:.3f} |")
    lines += [
        "",
        *(f"* {g}: {'met' if ok else 'NOT met'}" for g, ok in results["goals"].items()),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
