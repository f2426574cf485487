"""The generator's workers start with ``spawn`` where a forked worker could not
use CUDA, as vLLM's engine decides for its own.

Why:
    speculators builds ``MultiprocExecutor`` by hand, so its workers start
    with vLLM's default method, ``fork``. Before that, the main process has
    already asked the CUDA runtime for its device count without initialising
    torch's CUDA state: ``torch.cuda.is_available()`` while vLLM's imports load
    ``torch._inductor`` (its benchmarking module) and triton's drivers, before
    ``import vllm`` sets ``PYTORCH_NVML_BASED_CUDA_CHECK``. PyTorch marks every
    later fork as bad for CUDA, and each worker dies in ``init_device``:
    "Cannot re-initialize CUDA in forked subprocess". vLLM's own check
    (``_maybe_force_spawn``) only sees ``torch.cuda.is_initialized()``, which
    is still False. speculators' view of the executor asks the question
    directly: a child forked for a moment reports whether PyTorch would
    refuse it CUDA (``torch.cuda._is_in_bad_fork``). If so, or if CUDA is
    initialised, the workers are started with ``spawn`` for that constructor
    only (``VLLM_WORKER_MULTIPROC_METHOD`` is set and restored around it);
    a ``spawn`` the user chose is kept. vLLM's CPU platform spawns its
    workers itself.
Upstream change:
    None by itself: vLLM's engine chooses the start method before it starts
    workers (``get_mp_context`` / ``_maybe_force_spawn``); the executor
    speculators builds by hand inherits ``fork``, which stopped being safe once
    vLLM's imports reach the CUDA runtime (seen with vLLM 0.23 and 0.24 on
    CUDA).
Upstream PR:
    none: not an upstream change.
Remove when:
    speculators chooses its workers' start method, or builds on vLLM's engine.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import warnings
from typing import Any

from specshim._environ import scoped_environ
from specshim._types import Incompatible, NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import wrap

logger = logging.getLogger(__name__)

START_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"
_BAD_FORK = 3  # the probe child's exit status when PyTorch refuses it CUDA


def fork_breaks_cuda(wait_s: float = 10.0) -> bool:
    """Whether a process forked now could not use CUDA (PyTorch's verdict).

    A child that does not report within ``wait_s`` (an at-fork handler stuck
    on a lock another thread held) is killed, and counts as a yes: ``fork``
    is no safe way to start workers from this process either.
    """
    import torch

    if not torch.cuda._is_compiled():
        return False
    if torch.cuda.is_initialized():
        return True
    with warnings.catch_warnings():  # 3.12+: fork of a threaded process
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child only reads PyTorch's flag and leaves
        status = _BAD_FORK
        try:
            status = _BAD_FORK if torch.cuda._is_in_bad_fork() else 0
        finally:
            os._exit(status)
    deadline = time.monotonic() + wait_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) != 0
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return True
        time.sleep(0.01)


def construct(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Build the executor, with ``spawn`` workers where ``fork`` would break."""
    requested = os.environ.get(START_METHOD)
    if requested == "spawn" or not fork_breaks_cuda():
        return cls(*args, **kwargs)
    logger.info(
        "specshim: starting the generator's workers with 'spawn': a forked "
        "worker could not use CUDA in this process (%s was %r)",
        START_METHOD,
        requested,
    )
    with scoped_environ({START_METHOD: "spawn"}):
        return cls(*args, **kwargs)


def _probe(original: Any) -> None:
    import vllm.envs as envs
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        raise NotNeeded("vLLM's CPU platform starts its workers with spawn")
    if START_METHOD not in getattr(envs, "environment_variables", {}):
        raise Incompatible(f"vllm.envs.{START_METHOD}", "no such variable")
    import torch

    if not hasattr(torch.cuda, "_is_in_bad_fork"):
        raise Incompatible("torch.cuda._is_in_bad_fork", "no such function")


PATCH = declare(
    __name__,
    __doc__,
    id="worker-start-method",
    attribute="MultiprocExecutor",
    versions=">=0.11",
    probe=_probe,
    build=lambda original: wrap(original, construct),
    platform="cuda",
    drift_rows=(27,),
)
