"""``make bench``: specshim + speculators 0.3.0 against the alternatives.

One run on one machine, the systems interleaved round by round:

* ``specshim``: speculators 0.3.0's unmodified generator with ``import specshim``
  on vLLM 0.16 (the project's ``.venv``);
* ``spec041``: speculators 0.4.0.1 (which ported the generator to vLLM 0.16 by
  editing it) on the same vLLM, in ``.venv-bench-spec041``, built here with uv;
* ``hf``: Hugging Face transformers, bfloat16, forward hooks, one sequence at a
  time.

Then a sweep of specshim's step budget (``specshim.configure``) and
``generate()`` batch size, the goals checked, and the results written to
``benchmarks/results/`` (JSON, markdown, PNG) and, with ``--write-table``, the
results table of ``docs/performance.md``. Every number here is a measurement of
this run.

What is measured is in ``plan``, how in ``execute``, the verdicts in ``judge``
and the outputs in ``render``; this file is the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import execute
import judge
import render
from plan import HERE, LABELS, MODELS, NOTES, RUN_ENV, SWEEP, SYSTEMS, tuned_label


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--sweep-rounds", type=int, default=2)
    parser.add_argument(
        "--sweep-points", type=int, default=len(SWEEP), help="first N (smoke runs)"
    )
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument(
        "--write-table",
        metavar="PAGE",
        help="write the results table into PAGE (docs/performance.md)",
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="only redo the outputs from bench-raw.json",
    )
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The raw runs: the sweep, then the systems side by side, then import time."""
    systems = [s for s in args.systems.split(",") if s]
    models = [m for m in args.models.split(",") if m]
    setup = execute.prepare(systems, models, args.seqs)
    data: dict[str, Any] = {
        "meta": {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, "
            f"Python {platform.python_version()}",
            "rounds": args.rounds,
            "sweep_rounds": args.sweep_rounds,
            "num_seqs": args.seqs,
            "tokens": setup.tokens,
            "env": dict(RUN_ENV),
        },
        "compare": [],
        "sweep": [],
        "notes": list(NOTES),
    }
    # 1. The sweep (specshim only), to choose extract's step budget.
    if not args.no_sweep and "specshim" in systems:
        data["sweep"] = execute.sweep(
            setup, args.sweep_rounds, SWEEP[: args.sweep_points]
        )
    chosen = judge.chosen_point(data)
    data["extract_defaults"] = list(chosen) if chosen else None
    if chosen and "specshim" in systems:
        systems.insert(systems.index("specshim") + 1, "specshim-tuned")
        data["labels"] = {**LABELS, "specshim-tuned": tuned_label(chosen)}
    # 2. The systems side by side, interleaved round by round.
    data["compare"] = execute.compare(setup, systems, args.rounds, chosen)
    data["import"] = execute.import_time_ms()
    return data


def finish(data: dict[str, Any], out: Path, page: str | None) -> None:
    """Summaries, goals, and every output file, from the raw runs in ``data``."""
    data["summary"] = judge.summarize(data)
    data["goals"] = judge.goals(data)
    render.write_all(data, out, Path(page) if page else None)
    print(render.summary_text(data))
    execute.log(
        f"wrote {out}/bench.json, bench.md, bench.png"
        + (", sweep.png" if data["summary"]["sweep"] else "")
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.render:
        finish(json.loads((out / "bench-raw.json").read_text()), out, args.write_table)
        return 0
    data = measure(args)
    # The raw runs first: if summarizing fails, --render redoes it from here.
    (out / "bench-raw.json").write_text(json.dumps(data, indent=2, default=str))
    finish(data, out, args.write_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
