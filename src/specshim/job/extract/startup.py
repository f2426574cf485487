"""Progress lines while vLLM starts, so that a long start-up does not look hung.

A first start on a fresh GPU host can stay silent for minutes after vLLM's
last line (kernels compile). While the generator is being built, a thread
logs a line every ``INTERVAL`` seconds with the time so far and the phase the
start-up is in, read from the main thread's stack: which of speculators'
start-up steps is running, and which RPC the workers are answering.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger("specshim.job.extract.command")

INTERVAL = 30.0  # seconds between lines

# Innermost match wins: a function on the main thread's stack, or the method
# an executor's ``collective_rpc`` is waiting for.
PHASES = {
    "compile_or_warm_up_model": "compiling and warming up kernels",
    "initialize_from_config": "allocating the KV cache, compiling and warming up "
    "kernels",
    "determine_available_memory": "profiling memory",
    "get_kv_cache_spec": "reading the KV-cache layout",
    "wait_for_ready": "starting the workers and loading the weights",
    "_init_executor": "starting the workers and loading the weights",
    "_create_vllm_config": "reading the model's configuration",
}


def phase(frame: Any) -> str:
    """The start-up phase the innermost recognised frame of ``frame``'s stack
    belongs to."""
    while frame is not None:
        code = frame.f_code.co_name
        if code == "collective_rpc":
            method = frame.f_locals.get("method")
            name = (
                method if isinstance(method, str) else getattr(method, "__name__", "")
            )
            if name in PHASES:
                return PHASES[name]
        elif code in PHASES:
            return PHASES[code]
        frame = frame.f_back
    return "starting"


@contextlib.contextmanager
def announced(what: str = "extract") -> Iterator[None]:
    """Log a line every ``INTERVAL`` seconds until the block ends."""
    main = threading.get_ident()
    done = threading.Event()
    began = time.monotonic()

    def watch() -> None:
        while not done.wait(INTERVAL):
            frame = sys._current_frames().get(main)
            logger.info(
                "%s: vLLM is still starting (%.0f s so far): %s",
                what,
                time.monotonic() - began,
                phase(frame),
            )

    thread = threading.Thread(target=watch, name="specshim-startup", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
