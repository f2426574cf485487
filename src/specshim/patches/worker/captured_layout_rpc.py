"""An RPC that tells the main process which request owns which captured rows.

Why:
    speculators' main process slices captured rows by position and cannot
    notice a reordered or incomplete batch. ``row-layout`` records, for
    every executed step, the requests in the order their tokens were laid out;
    this adds ``HiddenStatesWorkerExtension._specshim_captured_layout()`` so
    ``generate-guard`` can fetch (and clear) that record after each
    ``generate()``.
Upstream change:
    None: part of specshim's alignment guard.
Remove when:
    ``generate-guard`` is removed.
"""

from __future__ import annotations

from typing import Any

from specshim._registry import Incompatible, Patch, register
from specshim.patches._util import WORKER


def captured_layout(self: Any) -> list[tuple[str, int]] | None:
    """The recorded (request id, rows) pairs since the last call; None if the
    recording is not armed (``row-layout`` not applied in this worker)."""
    if not hasattr(self, "_specshim_layout"):
        return None
    layout = list(self._specshim_layout)
    self._specshim_layout = []
    return layout


def _probe(original: Any) -> None:
    if original is not None:
        raise Incompatible("no attribute _specshim_captured_layout", repr(original))


PATCH = register(
    Patch(
        id="captured-layout-rpc",
        process="worker",
        module=WORKER,
        attribute="HiddenStatesWorkerExtension._specshim_captured_layout",
        package="vllm",
        versions=">=0.11",
        probe=_probe,
        build=lambda original: captured_layout,
        why=__doc__ or "",
        upstream="none: part of the alignment guard",
        remove_when="generate-guard is removed",
        replaces=True,
    )
)
