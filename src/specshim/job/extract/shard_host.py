"""What one host can run of ``extract --data-parallel N``, each shard's life
tied to the command's, and what a shard's log says of how it ended
(``parallel`` starts and watches the shards)."""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specshim._base import UsageError

FILES_PER_SHARD = 4  # this process's log of it, and what Popen opens briefly
FILES_SPARE = 64  # what this process itself keeps open


def refuse_beyond_the_host(count: int, tp: int, gpus: list[str] | None) -> None:
    """More shards than this host can run, refused before any starts: on a
    CPU host more than its cores (each shard's workers need one at least),
    anywhere more than the open-file limit lets this process watch (at 32
    files, 26 shards started and the command ended in a traceback)."""
    if gpus is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        if count * tp > cores:
            raise UsageError(
                f"--data-parallel {count} x --tp {tp} needs {count * tp} CPU cores "
                f"at least; this host lets the run use {cores}"
            )
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = count * FILES_PER_SHARD + FILES_SPARE
    if soft != resource.RLIM_INFINITY and needed > soft:
        raise UsageError(
            f"--data-parallel {count} needs about {needed} open files; the limit "
            f"is {soft} (raise it with ulimit -n, or run fewer shards)"
        )


def die_with_parent() -> Callable[[], None] | None:
    """What a child runs before it starts (None where the kernel has no such
    call): the kernel kills it when the process that started it dies, for
    any reason (SIGKILL included), so no shard outlives the command; its vLLM
    workers follow it (they watch their parent). Built here, in the parent:
    the child, forked beside this process's threads, must import nothing."""
    if sys.platform != "linux":
        return None
    import ctypes
    import functools

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1
    return functools.partial(prctl, pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)


def _tail(path: Path, size: int = 8192) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(max(path.stat().st_size - size, 0))
            return handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def failure(child: Any, out: Path) -> str:
    """Why a child failed: its own one-line error, else how it ended."""
    prefix = "specshim extract: error: "
    errors = [
        line[len(prefix) :]
        for line in _tail(child.slot.log(out)).splitlines()
        if line.startswith(prefix)
    ]
    if errors:
        return errors[-1]
    code = child.process.returncode
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with status {code} (the end of its log says why)"


def skipped(log: Path) -> int:
    """The samples a child found already written (its summary line says)."""
    found = re.findall(r"\((\d+) already there\)", _tail(log, 2048))
    return int(found[-1]) if found else 0
