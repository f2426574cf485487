"""Generators still open when the interpreter exits are shut down first, quietly.

Why:
    speculators shuts a generator's workers down only in ``__del__``. A script
    that keeps its generator until it ends (a module-level variable, a pytest
    fixture without a teardown, a generator caught in a reference cycle)
    reaches interpreter shutdown with the workers alive: multiprocessing's
    exit hook terminates them, vLLM's worker monitor logs "Worker proc
    VllmWorker-0 died unexpectedly", and ``__del__`` runs only after module
    globals are cleared, printing "Exception ignored in ... __del__"
    ('NoneType' object has no attribute 'warning'). And from vLLM 0.24 (0.16
    has none) a message queue holds an in-process PAIR socket whose linger
    is infinite: once the queue was shut down (vLLM does it after a worker
    error), the garbage collection of its zmq context waits for that socket
    forever, and a test run does not exit after its summary.

    A constructor that raises after it started the executor (a refusal at
    set-up: float16 DeepSeek, compiled mode) leaves the same behind: workers
    polling, and queues whose context's collection waits forever once
    anything shut them down (seen on vLLM 0.24.0's CUDA build: a pytest run
    hung in the garbage collection pytest's summary happened to start).

    The states a generator's calls returned through shared memory stay
    mapped in this process while its workers keep their slabs; a closed
    generator's workers keep nothing, but nothing told this process so: 8
    slabs, one call's states each, stayed mapped after ``close()`` until the
    process exited.

    This patch records every generator built, sets the linger of its
    executor's queue sockets to zero (nothing is left to deliver once a queue
    is being torn down), and registers an exit hook that runs before
    multiprocessing's: it shuts each open generator's executor down, closes
    the sockets, removes the executor and unmaps the slabs nothing holds
    (``specshim.close``, in ``specshim/_closing.py``), so speculators'
    ``__del__`` has nothing left to do; a generator collected unclosed has its
    slabs unmapped after ``__del__``. A constructor that raises is closed that
    way before its error goes on. While closing, ``specshim.close`` waits up
    to ``GRACE_S`` for the signalled workers before vLLM's own 5 s wait, whose
    SIGTERM comes with a warning (a slow CPU worker on a busy machine printed
    it at a script's exit).
Upstream change:
    None by itself: speculators 0.3.0 closes its executor only in ``__del__``;
    vLLM added the queues' cancel sockets between 0.16 and 0.24
    (``shm_broadcast.py``'s ``SpinCondition``).
Upstream PR:
    none: not an upstream change.
Remove when:
    speculators closes its generator at exit (a ``close()`` and an exit hook).
"""

from __future__ import annotations

import atexit
import functools
import logging
import weakref
from typing import Any

from specshim._closing import close, no_linger, worker_pids, workers_gone
from specshim.patches._declare import declare
from specshim.patches._wrappers import require_callable

logger = logging.getLogger(__name__)

_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()
_HOOKED: list[bool] = []


def _close_open() -> None:
    # At exit a log handler may hold a stream already closed (pytest's capture
    # once its run is over): vLLM's shutdown lines ("[shutdown] Executor:
    # waiting for worker exit", 0.25+) then went out as "--- Logging error
    # ---" tracebacks after the summary. Such a line has nowhere to go; drop it.
    raising, logging.raiseExceptions = logging.raiseExceptions, False
    try:
        for generator in list(_OPEN):
            try:
                close(generator)
            except Exception as exc:  # noqa: BLE001 - exiting: say it, go on
                logger.debug("specshim: closing a generator at exit: %r", exc)
    finally:
        logging.raiseExceptions = raising


def _close_half_built(generator: Any) -> None:
    """Close what a constructor that raised had started; its error, not one
    met while closing, is what the caller sees."""
    try:
        close(generator)
    except Exception as exc:  # noqa: BLE001 - the constructor's error goes on
        logger.debug("specshim: closing a half-built generator: %r", exc)


def _build(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        try:
            original(self, *args, **kwargs)
        except BaseException:
            _close_half_built(self)
            raise
        executor = vars(self).get("executor")
        if executor is None:
            return
        no_linger(executor)
        _OPEN.add(self)
        # Collected without close(): speculators' __del__ shuts the workers
        # down first, then their slabs are unmapped here.
        weakref.finalize(self, workers_gone, worker_pids(executor)).atexit = False
        if not _HOOKED:  # registered after vLLM imported multiprocessing:
            _HOOKED.append(True)  # exit hooks run last-registered first
            atexit.register(_close_open)

    __init__.__specshim__ = True  # type: ignore[attr-defined]
    return __init__


PATCH = declare(
    __name__,
    __doc__,
    id="close-at-exit",
    attribute="VllmHiddenStatesGenerator.__init__",
    versions=">=0.11",
    probe=require_callable("VllmHiddenStatesGenerator.__init__"),
    build=_build,
)
