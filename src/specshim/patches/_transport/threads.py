"""The main process's copies of a call's states, on more than one core.

speculators clones every sequence's rows of every layer in the main process
(``h[a:b].clone().cpu()``). vLLM's executor sets that process to one torch
thread ("Reducing Torch parallelism ... to avoid unnecessary CPU contention").
On an H200 host those clones took half of ``generate()``'s time once the
states stopped travelling as pickles (1.2B Llama: 0.97 of 1.96 s under
cProfile, about 2 GB/s: each clone writes fresh memory, which the kernel maps
in page by page). The workers wait for the next RPC while the main process
clones, so nothing contends: ``generate-guard`` lends the clones up to
``COPY_THREADS`` cores for the call and gives the old setting back after it.

Since then ``state-transport`` hands those clones the rows they ask for
instead of copying them (``patches/_transport/handed_states.py``); the threads
still serve the paths that copy: the states pickled through the RPC queue
(``SPECSHIM_DISABLE=state-transport``), the guard's re-slicing where the
workers cannot order rows, and, with the prefix cache on, the copies that put
served rows back in front of computed ones (``prefix_rows.stitch``), which run
after speculators' call returns and so borrow the threads again.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

COPY_THREADS = 8


def copy_threads() -> int:
    """How many threads the main process copies with: up to ``COPY_THREADS``,
    no more than the cores this process may run on; 1 where vLLM's workers
    compute on the CPU, whose cores the copies would take from them (torch's
    idle threads also spin for a while after each copy)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(COPY_THREADS, cores))


@contextlib.contextmanager
def lent_threads() -> Iterator[None]:
    """torch's intra-op threads raised to ``copy_threads()`` inside the block
    (never lowered), restored after it."""
    import torch

    before = torch.get_num_threads()
    wanted = max(before, copy_threads())
    if wanted != before:
        torch.set_num_threads(wanted)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
