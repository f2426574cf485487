"""What the state transport brought into this process: the shared slabs it
mapped (each one a worker made) and the bytes of states that came through
vLLM's queue instead (no free slab). The hand-over adds to the tally; a run's
closing lines read it (``extract``). It lives outside ``patches/`` so that a
caller never breaks when the transport's patch is removed: the tally then
stays at zero."""

from __future__ import annotations

_TALLY = {"slabs": 0, "queued_bytes": 0}


def add(slabs: int = 0, queued_bytes: int = 0) -> None:
    _TALLY["slabs"] += slabs
    _TALLY["queued_bytes"] += queued_bytes


def tally() -> dict[str, int]:
    """Slabs mapped and bytes received through the queue since this process
    started."""
    return dict(_TALLY)
