"""state-transport without vLLM: the input-order layout, the shared region and
its descriptors, and the fallback. The real workers are compared bit for bit
in tests/e2e/test_reference_match.py."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from specshim import SpecShimError
from specshim.patches.worker import _shared_states, state_transport
from specshim.patches.worker._shared_states import HostRegion


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


def test_runs_are_laid_out_in_input_order_with_the_record_permuted_alike():
    batch = [[5, 6, 7], [1, 2], [5, 6, 7], [9]]
    # Two forwards, each sorted by token count as the V2 runner does.
    forwards = [_forward([[5, 6, 7], [1, 2]]), _forward([[5, 6, 7], [9]])]
    pieces, entries, moved = state_transport.input_order(batch, forwards)
    assert pieces == [(0, 0, 5), (1, 0, 4)]  # adjacent runs merge into one copy
    assert moved == 0
    assert [e[0].tolist() for e in entries] == batch
    assert all(
        e[3] is None and e[2] == len(b) for e, b in zip(entries, batch, strict=True)
    )


def test_moved_runs_are_counted_and_strays_go_last():
    batch = [[1, 2], [3, 4, 5]]
    forwards = [_forward([[3, 4, 5], [8, 8], [1, 2]])]
    pieces, entries, moved = state_transport.input_order(batch, forwards)
    assert pieces == [(0, 5, 2), (0, 0, 5)]  # the stray follows in one copy
    assert [e[0].tolist() for e in entries] == [[1, 2], [3, 4, 5], [8, 8]]
    assert moved == 3


@pytest.mark.parametrize(
    "forwards",
    [
        [(None, None, 4, "no provenance")],  # an unprovable forward
        [(torch.tensor([1, 2]), torch.tensor([3, 4]), 2, None)],  # a partial prefill
    ],
)
def test_what_the_guard_will_refuse_keeps_the_capture_order(forwards):
    assert state_transport.input_order([[1, 2]], forwards) is None
    assert state_transport.input_order(None, [_forward([[1, 2]])]) is None


class _Worker:
    def __init__(self, forwards: list[tuple], directory: str | None = None) -> None:
        self._captured_states = _states(forwards)
        self._specshim_expected = None
        self._specshim_provenance = None
        if directory is not None:
            self._specshim_region = HostRegion(directory)


def _received(reply: list) -> list[torch.Tensor]:
    return [pickle.loads(pickle.dumps(d, protocol=5)) for d in reply]


@pytest.mark.parametrize("directory", [None, "/nonexistent-shm"])
def test_what_arrives_is_the_rows_in_the_pieces_order(directory):
    forwards = [_forward([[1, 2, 3], [4]]), _forward([[5, 6]])]
    worker = _Worker(forwards, directory)
    captured = worker._captured_states
    pieces = [(1, 0, 2), (0, 3, 1), (0, 0, 3)]
    got = _received(state_transport.send(worker, captured, pieces))
    for layer, states in zip(captured, got, strict=True):
        want = torch.cat([layer[f][s : s + n] for f, s, n in pieces])
        assert states.dtype == want.dtype and torch.equal(states, want)
    region = worker._specshim_region
    if directory is None:
        assert region.failure is None
        assert not os.path.exists(region.path)  # unlinked once attached
        region.close()
    else:
        assert "could not hold" in region.failure


def test_a_region_grows_and_old_views_keep_their_rows():
    worker = _Worker([_forward([[1, 2]])])
    first = _received(
        state_transport.send(worker, worker._captured_states, [(0, 0, 2)])
    )
    kept = first[0].clone()
    worker._captured_states = _states([_forward([list(range(3000))])])
    bigger = _received(
        state_transport.send(worker, worker._captured_states, [(0, 0, 3000)])
    )
    assert bigger[0].shape == (3000, 2)
    assert torch.equal(first[0], kept)  # the old mapping is still alive
    worker._specshim_region.close()


def test_a_descriptor_of_an_overwritten_fetch_refuses_to_be_read():
    worker = _Worker([_forward([[1, 2]])])
    reply = state_transport.send(worker, worker._captured_states, [(0, 0, 2)])
    stale = pickle.dumps(reply[0])
    _received(state_transport.send(worker, worker._captured_states, [(0, 0, 2)]))
    rows = pickle.loads(stale)
    assert isinstance(rows, _shared_states.Unattached)
    with pytest.raises(SpecShimError, match="overwritten before this process"):
        rows[0:1]
    worker._specshim_region.close()


def test_a_region_nobody_attached_is_removed_on_close(tmp_path):
    worker = _Worker([_forward([[1, 2]])], str(tmp_path))
    state_transport.send(worker, worker._captured_states, [(0, 0, 2)])
    assert len(os.listdir(tmp_path)) == 1
    worker._specshim_region.close()
    assert os.listdir(tmp_path) == []


def test_get_captured_states_uses_the_expected_order_and_forgets_it():
    class Record:
        forwards = [_forward([[3, 4, 5], [1, 2]])]
        moved = 0

    worker = _Worker(Record.forwards)
    record = worker._specshim_provenance = Record()
    worker._specshim_expected = [[1, 2], [3, 4, 5]]
    layers = _received(state_transport.get_captured_states(worker))
    assert layers[0][:, 0].tolist() == [3, 4, 0, 1, 2]  # row numbers in the forward
    assert record.moved == 2
    assert [e[0].tolist() for e in record.forwards] == [[1, 2], [3, 4, 5]]
    assert worker._captured_states is None and worker._specshim_expected is None
    assert state_transport.get_captured_states(worker) is None
    worker._specshim_region.close()


def test_the_transport_microbenchmark_moves_the_same_rows_both_ways():
    """benchmarks/transport_bench.py (the CPU proxy of the GPU figures) runs,
    and each transport hands over the worker's rows bit for bit (it raises
    otherwise); its speed is recorded in benchmarks/results, not judged here."""
    import sys
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(benchmarks))  # the spawned worker imports it too
    try:
        import transport_bench

        found = transport_bench.measure(mb=4, repeats=1)
    finally:
        sys.path.remove(str(benchmarks))
        sys.modules.pop("transport_bench", None)
    assert found["pickled_mib_per_s"] > 0 and found["shared_mib_per_s"] > 0


def test_the_main_process_copies_on_lent_threads_and_gives_them_back(monkeypatch):
    from specshim.patches import _threads

    monkeypatch.setattr(_threads, "copy_threads", lambda: 3)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.raises(RuntimeError), _threads.lent_threads():
            assert torch.get_num_threads() == 3
            raise RuntimeError("a failing generate()")
        assert torch.get_num_threads() == 1
        torch.set_num_threads(5)  # more than it would lend: never lowered
        with _threads.lent_threads():
            assert torch.get_num_threads() == 5
        assert torch.get_num_threads() == 5
    finally:
        torch.set_num_threads(before)


def test_regions_of_exited_workers_are_no_longer_held(monkeypatch):
    worker = _Worker([_forward([[1, 2]])])
    _received(state_transport.send(worker, worker._captured_states, [(0, 0, 2)]))
    held = worker._specshim_region.path
    assert held in _shared_states._ATTACHED
    other = _Worker([_forward([[1, 2]])])
    other._specshim_region = HostRegion()
    other._specshim_region.prefix = "specshim-states-999999999-beef"
    monkeypatch.setattr(
        _shared_states, "pid_alive", lambda pid: pid != os.getpid()
    )  # as if the first worker had exited
    _received(state_transport.send(other, other._captured_states, [(0, 0, 2)]))
    assert held not in _shared_states._ATTACHED
    assert other._specshim_region.path in _shared_states._ATTACHED
    worker._specshim_region.close()
    other._specshim_region.close()


def test_no_threads_are_lent_where_the_workers_compute_on_the_cpu():
    from vllm.platforms import current_platform

    from specshim.patches import _threads

    assert current_platform.is_cpu()  # this tier runs vLLM's CPU build
    assert _threads.copy_threads() == 1
