"""What the state-transport tests share: forwards as the V2 runner records
them, captured states that say where each row came from, a stand-in worker,
and the trip through pickle a reply takes to the caller."""

from __future__ import annotations

import pickle
from typing import Any

import torch

from specshim.patches._transport.shared_states import HostRegion


def _forward(runs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, int, None]:
    ids = torch.tensor([t for run in runs for t in run])
    positions = torch.tensor([p for run in runs for p in range(len(run))])
    return ids, positions, len(ids), None


def _states(forwards: list[tuple]) -> list[list[torch.Tensor]]:
    """Two layers; each row holds its forward's index and its row number."""
    layers = []
    for scale in (1, -1):
        layer = []
        for f, (_, _, rows, _) in enumerate(forwards):
            row = torch.arange(rows, dtype=torch.float32)[:, None]
            layer.append(scale * torch.cat([row, torch.full_like(row, f)], 1))
        layers.append([t.to(torch.bfloat16) for t in layer])
    return layers


class _Worker:
    def __init__(self, forwards: list[tuple], directory: str | None = None) -> None:
        self._captured_states = _states(forwards)
        self._specshim_expected = None
        self._specshim_provenance = None
        if directory is not None:
            self._specshim_region = HostRegion(directory)


def _received(reply: Any) -> list[torch.Tensor]:
    if isinstance(reply, list):  # the fallback: one array per layer
        return [pickle.loads(pickle.dumps(d, protocol=5)) for d in reply]
    return pickle.loads(pickle.dumps(reply, protocol=5))


def _fetch(worker: _Worker, seed: int) -> list[torch.Tensor]:
    """One call of three rows through ``state_transport.send`` to the caller,
    checked against what was captured."""
    from specshim.patches.worker import state_transport

    worker._captured_states = _states([_forward([[seed, seed + 1, seed + 2]])])
    rows = _received(state_transport.send(worker, worker._captured_states, [(0, 0, 3)]))
    for got, want in zip(rows, worker._captured_states, strict=True):
        assert torch.equal(got, want[0])
    return rows
