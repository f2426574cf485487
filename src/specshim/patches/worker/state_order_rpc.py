"""An RPC that tells the worker which sequences a ``generate()`` call sends.

Why:
    ``state-transport`` lays the captured rows out in input order before they
    leave the worker, so that the V2 runner's order (a step's rows sorted by
    token count) costs a few copies on the GPU instead of a concatenation and
    a clone of every layer in the main process. It needs the call's sequences,
    in input order; ``generate-guard`` sends them with this RPC before
    speculators adds the requests. The worker forgets them at the next fetch.
    They also bound the call's rows, so that each captured layer can be
    copied into the call's slab while the forward goes on
    (``_transport/early_copies``).
    Only the guard's proof, in the main process, decides what is returned.
Upstream change:
    None: part of specshim's state transport.
Upstream PR:
    none: not an upstream change.
Remove when:
    ``state-transport`` is removed.
"""

from __future__ import annotations

from typing import Any

from specshim._types import Incompatible
from specshim.patches._declare import declare


def expect_rows(self: Any, sequences: list[list[int]]) -> None:
    """Remember the call's sequences (tensor-parallel rank 0 uses them), and
    have its rows copied out as they are captured (``early_copies``)."""
    from specshim.patches._transport import early_copies

    self._specshim_expected = sequences
    early_copies.begin(self, sequences)


def _probe(original: Any) -> None:
    if original is not None:
        raise Incompatible("no attribute _specshim_expect_rows", repr(original))


PATCH = declare(
    __name__,
    __doc__,
    id="state-order-rpc",
    attribute="HiddenStatesWorkerExtension._specshim_expect_rows",
    versions=">=0.11",
    probe=_probe,
    build=lambda original: expect_rows,
    replaces=True,
    requires=("state-transport",),  # it only feeds state-transport's layout
)
