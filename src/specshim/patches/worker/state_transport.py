"""Captured states leave the worker through shared host memory, in input order.

Why:
    speculators' ``_get_captured_states`` returns the call's states as GPU
    tensors through ``collective_rpc``. vLLM pickles a reply, and a torch
    tensor pickles through ``torch.save``: a synchronous, unpinned GPU-to-host
    copy into a byte string that crosses the message queue (over 24 MiB it
    overflows to zmq), and ``torch.load`` in the main process restores it
    onto ``cuda:0``, from where speculators copies it back slice by slice.
    Every byte was copied about 13 times, none of it overlapped with compute:
    on an H200, ``generate()`` ran at 3.4% of vLLM's own prefill. Under the
    V2 runner, which orders a step's rows by token count, ``generate-guard``
    then concatenated and cloned every layer again to restore input order.

    This replacement lays the rows out in input order where it can (the
    sequences come from ``generate-guard`` through ``state-order-rpc``; each
    run of rows is matched to its sequence by the tokens ``row-provenance``
    recorded for it, and the provenance record is permuted the same way, so
    the guard proves exactly what is returned and takes its fast path), copies
    them once into a slab of shared, pinned host memory and replies with a
    small descriptor that maps the slab in the main process
    (``shared_states``). speculators gets CPU tensors of the same values,
    shape and dtype as before and slices them as before; each clone it takes
    of a sequence's slice is handed the slab's rows under it instead of a
    fresh copy, and the slab is reused only once the caller has let go of
    them. What ``generate()`` returns is bit for bit what the old path
    returned. Where the rows were captured in input order (``generate-guard``
    sends a call's sequences in the runner's order), each layer is copied
    into the slab as it is captured, beside the rest of the forward
    (``_transport/early_copies``), and the fetch only waits for the last copy.
Upstream change:
    None: speculators 0.3.0's reply path as written for vLLM 0.11. vLLM's
    message queue sends numpy buffers out of band but never torch tensors.
Upstream PR:
    none: not an upstream change.
Remove when:
    speculators hands captured states over without pickling tensors.
"""

from __future__ import annotations

import bisect
from typing import Any

from specshim._base import SpecShimError
from specshim._types import Incompatible
from specshim.patches._declare import declare
from specshim.patches._transport import early_copies
from specshim.patches._transport.early_copies import stride_of
from specshim.patches._transport.rows import in_input_order, match_runs
from specshim.patches._transport.shared_states import (
    HostRegion,
    OwnedRows,
    SharedStates,
    region_of,
)
from specshim.patches._transport.slab import HEADER

Piece = tuple[int, int, int]  # (forward, first row in it, rows)


def input_order(
    expected: list[Any], forwards: list[Any]
) -> tuple[list[Piece], list[Any], int] | None:
    """Where each run of captured rows goes so that they leave in input order.

    ``forwards`` is ``row-provenance``'s record, one ``(token_ids, positions,
    rows, problem)`` entry per stored forward. Returns the pieces to copy in
    order, the record's entries permuted the same way (one per run), and how
    many runs moved; None keeps the capture order (no provenance, rows in
    input order already, or rows the guard will refuse anyway). Runs no
    sequence claims go last, in capture order, so the guard still sees and
    refuses them.
    """
    import torch

    if not expected or not forwards or any(f[3] is not None for f in forwards):
        return None
    ids = torch.cat([f[0].long() for f in forwards]).cpu()
    positions = torch.cat([f[1].long() for f in forwards]).cpu()
    rows = [int(f[2]) for f in forwards]
    if in_input_order(expected, ids, positions, rows):
        return None  # in order already: nothing moves
    try:
        found, strays = match_runs(expected, ids, positions, rows)
    except SpecShimError:
        return None
    order = [run for run in found if run is not None] + strays
    starts = [0]
    for n in rows[:-1]:
        starts.append(starts[-1] + n)
    pieces: list[Piece] = []
    entries = []
    for s, e in order:
        forward = bisect.bisect_right(starts, s) - 1
        pieces.append((forward, s - starts[forward], e - s))
        entries.append((ids[s:e], positions[s:e], e - s, None))
    moved = sum(a != b for a, b in zip(order, sorted(order), strict=True))
    return merged(pieces), entries, moved


def merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent pieces of the same forward as one copy."""
    out: list[Piece] = []
    for forward, start, n in pieces:
        if out and out[-1][0] == forward and sum(out[-1][1:]) == start:
            out[-1] = (forward, out[-1][1], out[-1][2] + n)
        else:
            out.append((forward, start, n))
    return out


def get_captured_states(self: Any) -> Any:
    """Replacement for ``HiddenStatesWorkerExtension._get_captured_states``."""
    captured = self._captured_states
    expected = getattr(self, "_specshim_expected", None)
    early = early_copies.take(self)  # its copies have landed
    self._captured_states = self._specshim_expected = None
    if captured is None:
        return None
    rows = [int(t.shape[0]) for t in captured[0]]
    pieces: list[Piece] = [(f, 0, n) for f, n in enumerate(rows)]
    record = getattr(self, "_specshim_provenance", None)
    if (
        record is not None
        and expected is not None
        and len(record.forwards) == len(rows)
    ):
        placed = input_order(expected, record.forwards)
        if placed is not None:
            pieces, record.forwards, record.moved = placed
    if early is not None and early.holds(captured, pieces):
        region = self._specshim_region
        region.early_fetches += 1
        return _described(region, early.slab, early.stride, captured, sum(rows))
    return send(self, captured, pieces)


def send(worker: Any, captured: list[list[Any]], pieces: list[Piece]) -> Any:
    """Copy the pieces of every layer into a free slab of the worker's shared
    region and return its descriptor (or, without a slab, the rows as numpy)."""
    import torch

    first = captured[0][0]
    total = sum(n for _, _, n in pieces)
    row_shape = tuple(first.shape[1:])
    row_bytes = first[:1].numel() * first.element_size()
    layer_bytes = total * row_bytes
    stride = stride_of(total, row_bytes)
    region = region_of(worker)
    slab = region.reserve(stride * len(captured), pin=first.is_cuda)
    if slab is None:
        return [OwnedRows(_gathered(layer, pieces).cpu()) for layer in captured]
    data = slab.base[HEADER:]
    for k, layer in enumerate(captured):
        into = data[k * stride : k * stride + layer_bytes].view(first.dtype)
        into = into.view(total, *row_shape)
        done = 0
        for forward, start, n in pieces:
            into[done : done + n].copy_(
                layer[forward][start : start + n], non_blocking=True
            )
            done += n
    if first.is_cuda:
        torch.cuda.current_stream().synchronize()
    return _described(region, slab, stride, captured, total)


def _described(
    region: HostRegion, slab: Any, stride: int, captured: list[list[Any]], total: int
) -> SharedStates:
    """The descriptor of a slab whose layers hold ``total`` rows each,
    ``stride`` bytes apart (stamped: the copies are complete)."""
    first = captured[0][0]
    shape = (total, *first.shape[1:])
    layers = [(k * stride, shape, first.dtype) for k in range(len(captured))]
    return SharedStates(slab.path, region.stamp(slab), layers, region.take_retired())


def _gathered(layer: list[Any], pieces: list[Piece]) -> Any:
    import torch

    return torch.cat([layer[f][s : s + n] for f, s, n in pieces])


def _probe(original: Any) -> None:
    if original is None or not callable(original):
        raise Incompatible(
            "HiddenStatesWorkerExtension._get_captured_states()", repr(original)
        )


PATCH = declare(
    __name__,
    __doc__,
    id="state-transport",
    attribute="HiddenStatesWorkerExtension._get_captured_states",
    versions=">=0.11",
    probe=_probe,
    build=lambda original: get_captured_states,
)
