"""What the row-provenance guard costs: its share of a generate() call.

For the tiny Llama and the tiny DeepSeek-V3 of ``make bench`` (256 sequences of
U[64, 1024] tokens, batches of 32, layers [2, 4, 7]):

* pass 1 times every ``generate()`` with nothing watching (the denominator);
* pass 2 runs the same batches with the guard's parts timed: in the main
  process ``perf_counter`` around ``prove_rows``, ``reorder`` and
  ``_sequences`` (and the extra RPC that fetches the record); in the worker,
  cProfile's cumulative time of the provenance hooks (``on_embed``,
  ``on_first_layer``, ``on_store``, ``take``), torch calls inside included.

cProfile inflates what it watches, so the share printed is an upper bound.

Usage: .venv/bin/python benchmarks/guard_cost.py [--seqs 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from execute import ensure_models, make_workload  # noqa: E402
from plan import LAYERS, RUN_ENV  # noqa: E402

HOOKS = ("on_embed", "on_first_layer", "on_store", "take")
MAIN_PARTS = ("prove_rows", "reorder", "_sequences")


def _worker_profile_start(worker: Any) -> None:
    import cProfile

    worker._specshim_guard_profile = cProfile.Profile()
    worker._specshim_guard_profile.enable()


def _worker_profile_stop(worker: Any) -> dict[str, float]:
    import pstats

    profile = worker._specshim_guard_profile
    profile.disable()
    seconds: dict[str, float] = {}
    for (filename, _line, name), row in pstats.Stats(profile).stats.items():
        if filename.endswith("row_provenance.py") and name in HOOKS:
            seconds[name] = seconds.get(name, 0.0) + row[3]
    return seconds


def _timed(module: Any, name: str, spent: dict[str, float]) -> None:
    original = getattr(module, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - started

    setattr(module, name, timed)


def measure(model: Path, seqs: list[list[int]], batch: int) -> dict[str, Any]:
    from speculators.data_generation import VllmHiddenStatesGenerator

    import specshim  # noqa: F401  (arms the patches)
    from specshim.patches.main import generate_guard

    generator = VllmHiddenStatesGenerator(
        str(model), layer_ids=list(LAYERS), max_model_len=2048
    )
    batches = [seqs[i : i + batch] for i in range(0, len(seqs), batch)]
    tokens = sum(map(len, seqs))
    try:
        generator.generate(batches[0])  # warm-up, not counted
        started = time.perf_counter()
        for chunk in batches:
            generator.generate(chunk)
        wall = time.perf_counter() - started

        main: dict[str, float] = {}
        for name in MAIN_PARTS:
            _timed(generate_guard, name, main)
        executor = generator.executor
        rpc = executor.collective_rpc
        rpc_seconds = [0.0]

        def timed_rpc(method: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return rpc(method, *args, **kwargs)
            finally:
                if method == "_specshim_row_provenance":
                    rpc_seconds[0] += time.perf_counter() - started

        executor.collective_rpc = timed_rpc
        rpc(_worker_profile_start)
        for chunk in batches:
            generator.generate(chunk)
        worker = rpc(_worker_profile_stop)[0]
        main["provenance RPC"] = rpc_seconds[0]
    finally:
        generator.executor.shutdown()
    guard = sum(main.values()) + sum(worker.values())
    return {
        "model": model.name,
        "tokens": tokens,
        "generate_seconds": round(wall, 3),
        "tokens_per_second": round(tokens / wall),
        "main_seconds": {k: round(v, 4) for k, v in main.items()},
        "worker_seconds": {k: round(v, 4) for k, v in worker.items()},
        "guard_seconds": round(guard, 4),
        "share": guard / wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model", choices=["llama", "deepseek_v3"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.update(RUN_ENV)
    models = ensure_models()
    seqs = json.loads(make_workload(args.seqs).read_text())["seqs"]
    names = [args.model] if args.model else ["llama", "deepseek_v3"]
    if len(names) > 1:  # one generator per process: vLLM keeps global state
        import subprocess

        rows = []
        for name in names:
            cmd = [sys.executable, __file__, "--model", name, "--seqs", str(args.seqs)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print("| model | tokens | generate s | tok/s | guard s | share |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['model']} | {r['tokens']} | {r['generate_seconds']} | "
                f"{r['tokens_per_second']} | {r['guard_seconds']} | "
                f"{100 * r['share']:.2f}% |"
            )
        for r in rows:
            print(
                f"{r['model']}: main {r['main_seconds']}, worker {r['worker_seconds']}"
            )
        if args.out:
            args.out.write_text(json.dumps(rows, indent=2) + "\n")
        return 0
    print(json.dumps(measure(models[names[0]], seqs, args.batch_size)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
