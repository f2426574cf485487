"""``specshim extract`` with torch's profiler in its worker over some of its
generate() calls (``reuse_bench.py --worker-profile``): where a call's time
goes inside the job itself, with its writer and, under ``--reuse-prefixes``,
its store beside it, which ``bench-gpu --parts reuse-calls`` (the library
path, no writer) cannot show.

    python benchmarks/profiled_extract.py FIRST COUNT FILE extract --model ...

profiles calls FIRST to FIRST+COUNT-1 (1 is the first) and writes into FILE
one line ``WORKER-PROFILE {json}``: the calls' wall time, the device's busy
time in kernels and copies, the engine steps and tokens a step, and each
call's seconds; then torch's table of the top operations (a file, as
``extract`` sends its standard output to standard error while it runs)."""

from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any


def install(first: int, count: int, into: Path) -> None:
    """Wrap extract's ``_generate`` so that calls ``first`` to
    ``first + count - 1`` run under the worker's profiler."""
    from gpu_profiles import counted_steps

    from specshim.job.extract import command
    from specshim.testing.worker_probes import profile_start, profile_stop

    original = command._generate
    seen: dict[str, Any] = {"calls": 0, "seconds": [], "steps": ExitStack()}

    def generate(generator: Any, batch: list[Any], writer: Any) -> Any:
        seen["calls"] += 1
        n, last = seen["calls"], first + count - 1
        if not first <= n <= last:
            return original(generator, batch, writer)
        rpc = generator.executor.collective_rpc
        if n == first:  # the calls' forward steps, and the profiler
            seen["tokens"] = seen["steps"].enter_context(
                counted_steps(generator.executor)
            )
            rpc(profile_start)
        began = time.perf_counter()
        try:
            return original(generator, batch, writer)
        finally:
            seen["seconds"].append(round(time.perf_counter() - began, 4))
            if n == last:
                found = rpc(profile_stop)[0]
                seen["steps"].close()
                table = found.pop("table")
                found |= {"calls": [first, last], "calls_s": seen["seconds"]}
                found |= {"wall_s": round(sum(seen["seconds"]), 4)}
                found |= {"tokens_per_step": seen["tokens"]}
                line = "WORKER-PROFILE " + json.dumps(found)
                into.write_text(f"{line}\n{table}\n")

    command._generate = generate


def main(argv: list[str]) -> int:
    first, count, into, rest = int(argv[0]), int(argv[1]), Path(argv[2]), argv[3:]
    import specshim  # noqa: F401  (first: it arms the patches speculators needs)

    install(first, count, into)
    from specshim.cli import main as specshim_main

    return specshim_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
