"""An RPC that hands the main process the provenance of the captured rows.

Why:
    ``row-provenance`` records, in each worker, the token id and position
    every captured row was computed from. This adds
    ``HiddenStatesWorkerExtension._specshim_row_provenance()`` so that
    ``generate-guard`` can fetch (and clear) that record after each
    ``generate()`` and prove every returned row from it.
Upstream change:
    None: part of specshim's alignment guard.
Upstream PR:
    none: not an upstream change.
Remove when:
    ``generate-guard`` is removed.
"""

from __future__ import annotations

from typing import Any

from specshim._types import Incompatible
from specshim.patches._declare import declare


def row_provenance(self: Any) -> dict[str, Any] | None:
    """The provenance recorded since the last call (see ``Provenance.take``);
    None where nothing records it (``row-provenance`` not applied, or a TP rank
    other than 0)."""
    record = getattr(self, "_specshim_provenance", None)
    return None if record is None else record.take()


def _probe(original: Any) -> None:
    if original is not None:
        raise Incompatible("no attribute _specshim_row_provenance", repr(original))


PATCH = declare(
    __name__,
    __doc__,
    id="row-provenance-rpc",
    attribute="HiddenStatesWorkerExtension._specshim_row_provenance",
    versions=">=0.11",
    probe=_probe,
    build=lambda original: row_provenance,
    replaces=True,
    requires=("row-provenance",),  # it returns what row-provenance records
)
