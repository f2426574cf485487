"""Each CPU worker asks Linux for the AMX tile state before its first forward.

Why:
    Linux lets a process run AMX tile instructions only after it asked for
    the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); before that, the
    first one kills it with SIGILL. On a CPU with AMX, vLLM's CPU attention
    runs AMX kernels for bfloat16 with blocks of a multiple of 32 tokens,
    which the CPU platform's 128-token blocks are from 0.29 on
    (``cpu-block-size``), and does not ask for that state itself: oneDNN asks
    when its first AMX matmul runs, which vLLM's own engine reaches in its
    compiled warm-up. speculators' engine is eager and has no such warm-up,
    so a first call of short sequences (matmuls too small for AMX) reaches the
    AMX attention unasked, and the worker dies (seen on vLLM 0.32.0: a call
    of 3 tokens then one of 2, "Worker proc VllmWorker-0 died unexpectedly
    (exit code: -4)"). Before the capture is set up, each worker asks
    (``torch.cpu._init_amx()``, which does nothing on a CPU without AMX).
Upstream change:
    vLLM 0.29: the CPU platform's block size (128) reaches the CPU attention
    backend under speculators (``cpu-block-size``), whose AMX path needs
    ``block_size % 32 == 0``; before, speculators' 16-token blocks ran its
    vector kernels.
Upstream PR:
    none found: vLLM's CPU attention does not request AMX permission.
Remove when:
    vLLM's CPU worker or attention kernels request the AMX tile state
    themselves, or speculators warms its engine up as vLLM's does.
"""

from __future__ import annotations

from typing import Any

from specshim._types import Incompatible
from specshim.patches._declare import declare
from specshim.patches._wrappers import require_callable, wrap_call
from specshim.patches.main.cpu_block_size import require_platform_blocks

_SETUP = "HiddenStatesWorkerExtension._setup_hidden_states_capture(layer_ids)"


def ask_for_amx() -> bool:
    """Ask for the AMX tile state where the CPU has AMX; whether it is granted
    (False on a CPU without AMX, where nothing needs it)."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


def _probe(original: Any) -> None:
    require_callable(_SETUP)(original)
    require_platform_blocks()  # where cpu-block-size applies: 128-token blocks
    import torch

    missing = [
        name
        for name in ("_is_amx_tile_supported", "_init_amx")
        if not callable(getattr(torch.cpu, name, None))
    ]
    if missing:
        raise Incompatible("torch.cpu._init_amx (torch 2.3 and later)", str(missing))


PATCH = declare(
    __name__,
    __doc__,
    id="cpu-amx-tiles",
    attribute="HiddenStatesWorkerExtension._setup_hidden_states_capture",
    versions=">=0.29",
    probe=_probe,
    build=lambda original: wrap_call(original, before=lambda *_: ask_for_amx()),
    platform="cpu",
)
