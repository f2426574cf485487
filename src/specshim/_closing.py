"""Closing a generator: ``specshim.close(generator)``, the one way the job and
a user's script shut speculators' generator down (the ``close-at-exit`` patch
calls it at exit, and for a constructor that raised).

It shuts the executor's workers down, closes the queue sockets vLLM leaves
open, and tells whatever keeps per-worker state in this process that those
workers are gone (``when_workers_gone``: the hand-over's mappings register
there when they are first made). It lives outside ``patches/`` so that
removing a patch, as each one's "Remove when" invites, never breaks a caller.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

GRACE_S = 20.0  # the most close() waits for signalled workers itself
_GONE: list[Callable[[list[int]], None]] = []


def when_workers_gone(callback: Callable[[list[int]], None]) -> None:
    """Call ``callback(pids)`` whenever a generator's workers are shut down
    (by ``close`` or after speculators' own ``__del__``)."""
    if callback not in _GONE:
        _GONE.append(callback)


def workers_gone(pids: list[int]) -> None:
    for callback in _GONE:
        callback(pids)


def close(generator: Any) -> None:
    """Shut the generator's workers down and close its queue sockets; the
    generator cannot generate afterwards. Doing it twice does nothing."""
    executor = vars(generator).pop("executor", None)
    if executor is None:
        return
    owners = _queues(executor)  # read first: shutdown() drops the queues
    pids = worker_pids(executor)
    _patient(executor)
    try:
        executor.shutdown()
    finally:
        for socket in _open_sockets(owners):
            socket.close(linger=0)
        workers_gone(pids)


def worker_pids(executor: Any) -> list[int]:
    """The process ids of the executor's workers (none known: an empty list)."""
    pids = []
    for handle in getattr(executor, "workers", None) or ():
        pid = getattr(getattr(handle, "proc", None), "pid", None)
        if isinstance(pid, int):
            pids.append(pid)
    return pids


def _patient(executor: Any) -> None:
    """Give the workers up to ``GRACE_S`` to exit before vLLM's own wait.

    vLLM waits ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5 s, read once the
    executor is built) for its signalled workers, then sends SIGTERM with a
    warning: on a busy 2-core machine a CPU worker took longer, and a
    script's exit printed "[shutdown] Executor: workers still running after
    grace period" (seen on vLLM 0.32.0). A value the user set is theirs."""
    ensure = getattr(executor, "_ensure_worker_termination", None)
    if ensure is None or "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS" in os.environ:
        return

    def patient(procs: list[Any]) -> None:
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            time.sleep(0.1)
        ensure(procs)

    executor._ensure_worker_termination = patient


def _queues(executor: Any) -> list[Any]:
    """The executor's message queues and their spin conditions (0.24+)."""
    queues = [
        getattr(executor, "rpc_broadcast_mq", None),
        *(getattr(executor, "response_mqs", None) or ()),
    ]
    owners = [*queues, *(getattr(q, "_spin_condition", None) for q in queues)]
    return [owner for owner in owners if owner is not None]


def _open_sockets(owners: list[Any]) -> list[Any]:
    """The zmq sockets the owners hold that are still open."""
    import zmq

    return [
        value
        for owner in owners
        for value in getattr(owner, "__dict__", {}).values()
        if isinstance(value, zmq.Socket) and not value.closed
    ]


def no_linger(executor: Any) -> None:
    """Nothing is left to deliver once a queue is torn down: its sockets'
    collection must not wait for it."""
    import zmq

    for socket in _open_sockets(_queues(executor)):
        socket.setsockopt(zmq.LINGER, 0)
