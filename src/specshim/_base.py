"""What every part of specshim shares: its exceptions and the names it targets.

A module that imports nothing, so that anything may import it.
"""

from __future__ import annotations

__all__ = [
    "GENERATOR",
    "HOOKED_MODULES",
    "INTERRUPTED",
    "PACKAGES",
    "TRANSFORMERS_CONFIG",
    "WORKER",
    "InterruptedRunError",
    "SpecShimError",
    "SpecShimWarning",
    "UsageError",
    "SHM_LIMIT",
    "STITCH_REGIONS",
    "WRITER_THREADS",
    "pid_alive",
    "shm_limit",
    "stitch_regions",
    "writer_threads",
]


class SpecShimError(RuntimeError):
    """A patch could not be applied, or specshim refused unsafe input."""


class UsageError(SpecShimError):
    """The command was called wrongly: a flag, a path or the input data.

    The command line exits with 2 for these and with 1 for other failures.
    """


class InterruptedRunError(SpecShimError):
    """The user stopped the command (Ctrl-C) and it stopped cleanly.

    The command line exits with ``INTERRUPTED``, what a shell reports for a
    command that SIGINT ended.
    """


INTERRUPTED = 130


class SpecShimWarning(UserWarning):
    """An optional patch could not be applied."""


# The three modules whose import arms the patches: speculators 0.3.0's
# generator (main process) and its worker extension (inside every vLLM worker),
# and transformers' config module, which speculators needs before it imports.
GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
WORKER = "speculators.data_generation.custom_worker"
# What speculators needs of its dependencies before it can even be imported
# (patches/deps/, in every process): transformers' config module.
TRANSFORMERS_CONFIG = "transformers.configuration_utils"
HOOKED_MODULES = (TRANSFORMERS_CONFIG, GENERATOR, WORKER)

# The packages whose versions decide what specshim does, as reports name them.
PACKAGES = ("vllm", "speculators", "torch", "transformers")


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (ours or another user's)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# The most shared memory the captured states' slabs may take
# (patches/_transport/shared_states.py): read in every worker, checked in the
# main process first.
SHM_LIMIT = "SPECSHIM_SHM_MIB"


def shm_limit() -> int | None:
    """``SPECSHIM_SHM_MIB`` in bytes: the most ``/dev/shm`` one worker's slabs
    may take (0: none, every call's states travel through vLLM's queue);
    None where it is not set (as much as ``/dev/shm`` holds)."""
    mib = _whole_number(
        SHM_LIMIT,
        0,
        "the most MiB of /dev/shm the captured states may take, a whole number "
        "(0: none)",
    )
    return None if mib is None else mib << 20


WRITER_THREADS = "SPECSHIM_WRITER_THREADS"


def writer_threads() -> int | None:
    """``SPECSHIM_WRITER_THREADS``: how many threads ``extract``'s writer
    serializes a batch's files with; None where it is not set (the writer's
    own choice)."""
    return _whole_number(
        WRITER_THREADS,
        1,
        "how many threads write extract's files, a whole number of at least 1",
    )


# The slabs a worker makes for the captured states as soon as the capture is
# set up, before the first call (patches/worker/prepared_slabs.py): for calls
# of at most SLAB_ROWS rows, SLABS of them (``extract`` sets both).
SLAB_ROWS = "SPECSHIM_SLAB_ROWS"
SLABS = "SPECSHIM_SLABS"


def prepared_slabs() -> tuple[int, int] | None:
    """``(rows, count)``: the slabs to make before the first call, for calls
    of at most ``rows`` captured rows (``SPECSHIM_SLAB_ROWS``), ``count`` of
    them (``SPECSHIM_SLABS``, 1 where not set); None where no rows are given."""
    rows = _whole_number(
        SLAB_ROWS, 0, "the most rows a call captures, a whole number (0: none)"
    )
    count = _whole_number(
        SLABS, 0, "how many slabs to make before the first call, a whole number"
    )
    if not rows or count == 0:
        return None
    return rows, 1 if count is None else count


# How many calls' joined rows the main process keeps memory mapped for, with
# the prefix cache on (patches/_transport/row_arena.py).
STITCH_REGIONS = "SPECSHIM_STITCH_REGIONS"


def stitch_regions() -> int | None:
    """``SPECSHIM_STITCH_REGIONS``: how many regions the joins of served rows
    may keep (0: none, every join in fresh memory); None where it is not set
    (``row_arena.REGIONS``)."""
    return _whole_number(
        STITCH_REGIONS,
        0,
        "how many calls' joined rows to keep memory for, a whole number (0: none)",
    )


def _whole_number(name: str, least: int, wanted: str) -> int | None:
    """The variable ``name`` as a whole number of at least ``least``; None
    where it is not set; anything else refused in one line ("give
    ``wanted``")."""
    import os

    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < least:
        raise UsageError(f"{name}={value}: give {wanted}")
    return int(value)
