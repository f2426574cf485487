"""A forked child for the tests that prove what generate() returns stays each
process's own across a fork (a DataLoader worker, a multiprocessing child
under fork)."""

from __future__ import annotations

import contextlib
import os
import signal
import warnings
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def forked(work: Callable[[], bool], seconds: int = 120) -> Iterator[int]:
    """Fork; the child runs ``work`` (exit status 0 where it returns True, 3
    where False, 1 where it raised; killed after ``seconds``) and leaves
    without the test's teardown. The parent gets the child's pid and, whatever
    it asserts meanwhile, never leaves the child running: one blocked on a pipe
    would hold the test runner's output open."""
    import torch

    with warnings.catch_warnings():  # the parent's threads: the child runs none
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(seconds)
            # OpenMP's threads do not survive a fork: one thread, as
            # DataLoader's workers set (else a parallel op waits forever).
            torch.set_num_threads(1)
            code = 0 if work() else 3
        finally:
            os._exit(code)
    try:
        yield pid
    finally:
        with contextlib.suppress(ChildProcessError):  # unless already reaped
            if os.waitpid(pid, os.WNOHANG) == (0, 0):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def exit_status(pid: int) -> int:
    """Wait for the child ``pid``: its exit status, or -1 where a signal
    ended it."""
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
