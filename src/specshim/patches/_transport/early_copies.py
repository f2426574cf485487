"""A call's captured rows copied into its slab while the forward still runs.

``state-transport`` copies a call's rows into a slab once the call's last
forward is done, and the GPU waits for that copy: on an H100 it was 6.75 ms
of a 133 ms step on a 1.2B Llama (29,000 tokens, three layers), with the
GPU idle around it. Here each captured layer is copied as soon as its hook
has computed it, on a stream of its own, while the later layers compute; the
fetch then only waits for the last copy.

The copies land in capture order, at the rows of the forwards before them, so
they are what ``state_transport.send`` would write only where the call's rows
need no reordering (one piece per forward, in order). ``holds`` says whether
they are, and the fetch uses them only then:

* every layer of every stored forward was copied, and the stored tensors are
  the very ones copied (a store that trims, pads or replaces rows stores
  other tensors: it is caught by identity, not by content);
* the input order is the capture order (``generate-guard`` sends a call's
  sequences in the order the runner computes them);
* the rows fit the slab's layout (the call's expected rows, from its
  sequences, bound it).

Anything else, and the fetch copies the call's rows again into its slab, as
without this (after these copies have finished, so they cannot land over
the new ones). Where a failed call leaves copies behind, the next call's
``begin`` waits for them first. The guard in the main process proves every
row it returns either way.
"""

from __future__ import annotations

import logging
from typing import Any

from specshim.patches._transport.slab import HEADER

logger = logging.getLogger(__name__)

ALIGN = 4096  # each layer's rows start on a page


def stride_of(rows: int, row_bytes: int) -> int:
    """Bytes between two layers' rows in a slab: ``rows`` rows, whole pages."""
    return -(-(rows * row_bytes) // ALIGN) * ALIGN


class EarlyCopies:
    """One call's copies of its layers into a slab, made as they are
    captured (on tensor-parallel rank 0, the only one that captures)."""

    def __init__(self, worker: Any, rows: int, layers: int) -> None:
        self.worker, self.rows, self.layers = worker, rows, layers
        self.slab: Any = None
        self.stride = self.row_bytes = 0
        self.kind: tuple[Any, ...] | None = None  # (row shape, dtype)
        self.copied: list[list[Any]] = [[] for _ in range(layers)]
        self.forwards: list[int] = []  # rows of each forward, as copied
        self.broken = False
        self.stream: Any = None

    def on_layer(self, position: int, state: Any) -> None:
        """Copy ``state``, the ``position``-th captured layer of a forward."""
        if self.broken:
            return
        try:
            self._copy(position, state)
        except Exception:  # noqa: BLE001 - the fetch copies the rows itself
            logger.debug("specshim: an early copy failed", exc_info=True)
            self.broken = True

    def _copy(self, position: int, state: Any) -> None:
        kind = (tuple(state.shape[1:]), state.dtype)
        if self.slab is None and not self._reserve(state, kind):
            self.broken = True
            return
        rows = int(state.shape[0])
        if position == 0:
            self.forwards.append(rows)
        done = sum(self.forwards[:-1])
        if (
            kind != self.kind
            or not self.forwards
            or rows != self.forwards[-1]
            or len(self.copied[position]) != len(self.forwards) - 1
            or done + rows > self.rows
        ):
            self.broken = True
            return
        begin = HEADER + position * self.stride + done * self.row_bytes
        into = self.slab.base[begin : begin + rows * self.row_bytes]
        into = into.view(state.dtype).view(rows, *kind[0])
        if state.is_cuda:
            self._copy_beside(into, state)
        else:
            into.copy_(state)
        self.copied[position].append(state)

    def _reserve(self, state: Any, kind: tuple[Any, ...]) -> bool:
        from specshim.patches._transport.shared_states import region_of

        self.row_bytes = state[:1].numel() * state.element_size()
        self.stride = stride_of(self.rows, self.row_bytes)
        region = region_of(self.worker)
        self.slab = region.reserve(self.stride * self.layers, pin=state.is_cuda)
        if self.slab is None or (state.is_cuda and not self.slab.pinned):
            self.slab = None  # an unpinned copy would stall the forward
            return False
        self.kind = kind
        return True

    def _copy_beside(self, into: Any, state: Any) -> None:
        import torch

        if self.stream is None:
            self.stream = _side_stream(state.device)
        self.stream.wait_stream(torch.cuda.current_stream(state.device))
        state.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            into.copy_(state, non_blocking=True)

    def finish(self) -> None:
        """Wait until every copy made so far has landed."""
        if self.stream is not None:
            self.stream.synchronize()

    def holds(self, captured: list[list[Any]], pieces: list[Any]) -> bool:
        """Whether the slab holds exactly the rows ``send`` would write for
        ``captured`` laid out as ``pieces`` (call ``finish`` first)."""
        if self.broken or self.slab is None or len(captured) != self.layers:
            return False
        if pieces != [(f, 0, n) for f, n in enumerate(self.forwards)]:
            return False
        return all(
            len(stored) == len(copied)
            and all(a is b for a, b in zip(stored, copied, strict=True))
            for stored, copied in zip(captured, self.copied, strict=True)
        )


_STREAMS: dict[Any, Any] = {}


def _side_stream(device: Any) -> Any:
    """One copy stream per device, for the life of the worker."""
    import torch

    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device=device)
    return _STREAMS[device]


def begin(worker: Any, sequences: list[Any] | None) -> None:
    """A call's early copies, from its sequences; the last call's copies
    finish first (a failed call may leave some in flight)."""
    old = getattr(worker, "_specshim_early", None)
    if old is not None:
        old.finish()
    worker._specshim_early = None
    layers = len(getattr(worker, "_layer_ids", ()) or ())
    if sequences and layers:
        rows = sum(len(ids) for ids in sequences)
        worker._specshim_early = EarlyCopies(worker, rows, layers)


def take(worker: Any) -> EarlyCopies | None:
    """The call's early copies, finished, and forgotten by the worker."""
    early = getattr(worker, "_specshim_early", None)
    worker._specshim_early = None
    if early is not None:
        early.finish()
    return early
