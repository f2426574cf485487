"""``bench-gpu --parts reuse-calls``: where a reused ``generate()`` call's
time goes, against the same call without the prefix cache.

The fifth H100 lease found a system-prompt call of ``extract
--reuse-prefixes`` at 0.42 s (median) against 0.254 s without, while it
computes a third of the tokens and the main process's own work in it is
about 37 ms. This part runs speculators' ``generate()`` (the library path,
``SPECSHIM_REUSE_PREFIXES`` on or off: ``--reuse``) over reuse_bench's
``system`` data set, batches of 32, and reports each call's wall time, the
engine steps each call took and the tokens scheduled in each, and, for a
few calls, the worker's profile (GPU busy time, the top operations by GPU
and by CPU time, in the part's log) and the main process's cProfile.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from gpu_profiles import counted_steps, profiled, worker_profiled
from reuse_bench import VOCAB, dataset

SAMPLES = 512
BATCH = 32
PROFILED = 3  # calls under each profiler (worker's, then main's), after the timed ones


def part_reuse_calls(args: argparse.Namespace, data: list[list[int]]) -> dict[str, Any]:
    del data  # reuse_bench's data set, not the bench's
    from gpu_parts import make_generator, set_generate_budget

    if args.reuse:
        os.environ["SPECSHIM_REUSE_PREFIXES"] = "1"  # read as the generator starts
    budget = set_generate_budget(args)
    generator = make_generator(args)
    cache = generator.vllm_config.cache_config
    samples = dataset("system", SAMPLES, VOCAB)
    batches = [samples[i : i + BATCH] for i in range(0, len(samples), BATCH)]
    calls, per_call, n = [], [], PROFILED
    with counted_steps(generator.executor) as steps:
        for batch in batches[: -2 * n]:
            before = len(steps)
            start = time.perf_counter()
            results = generator.generate(batch)
            calls.append(round(time.perf_counter() - start, 4))
            per_call.append(steps[before:])
            del results
    found: dict[str, Any] = {
        "reuse": bool(args.reuse),
        "prefix_caching": bool(cache.enable_prefix_caching),
        "max_batched_tokens": budget,
        "calls_s": calls,
        "median_after_first_s": statistics.median(calls[1:]),
        "steps_per_call": [len(s) for s in per_call],
        "tokens_per_step": per_call,
        "worker_profile": worker_profiled(generator, batches[-2 * n : -n]),
        "main_profile": profiled(generator, batches[-n:]),
    }
    generator.executor.shutdown()
    return found
