"""Profiles of ``generate()`` calls for ``bench-gpu --profile`` and
``--worker-profile``: where the main process spends its time, and the GPU's
busy time, forward steps and tokens a step against the calls' wall time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def counted_steps(executor: Any) -> Iterator[list[int]]:
    """The tokens of each forward step ``executor`` runs meanwhile, one entry
    a step."""
    tokens: list[int] = []
    execute = executor.execute_model

    def counted(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        tokens.append(int(scheduler_output.total_num_scheduled_tokens))
        return execute(scheduler_output, *args, **kwargs)

    executor.execute_model = counted
    try:
        yield tokens
    finally:
        del executor.execute_model


def worker_profiled(generator: Any, batches: list[Any]) -> dict[str, Any]:
    """``batches`` under torch's profiler in the worker: the wall time of
    their generate() calls against the GPU's busy time in kernels and copies
    (the table of the top operations goes to the part's log)."""
    from specshim.testing.worker_probes import profile_start, profile_stop

    rpc = generator.executor.collective_rpc
    with counted_steps(generator.executor) as tokens:  # the calls' forward steps
        rpc(profile_start)
        start = time.perf_counter()
        for batch in batches:
            generator.generate(batch)
        wall = time.perf_counter() - start
        found = rpc(profile_stop)[0]
    print(found.pop("table"), flush=True)
    found["steps"] = len(tokens)
    found["tokens_per_step"] = tokens
    return {"calls": len(batches), "wall_s": round(wall, 3)} | found


def profiled(generator: Any, batches: list[Any]) -> str:
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
