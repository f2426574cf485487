"""state-transport without vLLM: the input-order layout, the shared region and
its descriptors, and the fallback. The real workers are compared bit for bit
in tests/e2e/test_reference_match.py."""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest
import torch

from specshim import SpecShimError
from specshim.patches.worker import _handed_states, _shared_states, state_transport
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


def _received(reply: Any) -> list[torch.Tensor]:
    if isinstance(reply, list):  # the fallback: one array per layer
        return [pickle.loads(pickle.dumps(d, protocol=5)) for d in reply]
    return pickle.loads(pickle.dumps(reply, protocol=5))


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
        assert not os.path.exists(region.slabs[0].path)  # unlinked once attached
        region.close()
    else:
        assert "could not hold" in region.failure


def test_a_clone_of_a_slice_is_handed_its_rows_and_saves_as_a_copy_would():
    worker = _Worker([_forward([[1, 2, 3], [4, 5]])])
    layers = _received(
        state_transport.send(worker, worker._captured_states, [(0, 0, 5)])
    )
    want = [h.clone() for h in worker._captured_states[0]]
    first, second = layers[0][0:3].clone(), layers[0][3:5].clone().cpu()
    for got, copy in ((first, want[0][0:3].clone()), (second, want[0][3:5].clone())):
        assert type(got) is torch.Tensor and torch.equal(got, copy)
        assert got.untyped_storage().nbytes() == got.nbytes  # only its own rows
        assert _saved(got) == _saved(copy)  # torch.save writes the same bytes
    base = layers[0].data_ptr()
    assert first.data_ptr() == base  # handed over, not copied
    again = layers[0][2:4].clone()  # overlaps what was handed over: a copy
    assert again.data_ptr() not in (base, first.data_ptr(), second.data_ptr())
    assert torch.equal(again, want[0][2:4])
    worker._specshim_region.close()


def test_the_fallback_hands_its_rows_over_too_and_never_read_only_memory():
    import numpy as np

    worker = _Worker([_forward([[1, 2, 3], [4, 5]])], "/nonexistent-shm")
    layers = _received(
        state_transport.send(worker, worker._captured_states, [(0, 0, 5)])
    )
    got = layers[1][3:5].clone()
    assert got.data_ptr() == layers[1].data_ptr() + 3 * 2 * 2  # handed over
    assert torch.equal(got, worker._captured_states[1][0][3:5])
    frozen = np.frombuffer(bytes(8), dtype=np.uint8)  # as a queue may deliver it
    rows = _handed_states.received(frozen, (2, 2), "torch.bfloat16")
    rows[0:1].clone().add_(1)  # writable: the read-only buffer was copied
    assert frozen.tolist() == [0] * 8


def test_the_fallback_never_hands_over_memory_the_queue_writes_again():
    """Under its chunk size vLLM's queue unpickles the rows from a writable
    slice of its shared-memory ring, which later messages overwrite: what the
    caller got must not change with it."""
    import numpy as np

    ring = bytearray(64)
    window = np.frombuffer(memoryview(ring)[8:16], dtype=np.uint8)
    assert window.flags.writeable  # as dequeue hands it to pickle.loads
    rows = _handed_states.received(window, (2, 2), "torch.bfloat16")
    kept = rows[0:2].clone()
    want = kept.clone()
    ring[:] = b"\xff" * 64  # the worker writes the next messages there
    assert torch.equal(kept, want) and torch.equal(rows, want)


def _saved(tensor: torch.Tensor) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save({"hidden_states": [tensor]}, buffer)
    return buffer.getvalue()


def test_a_slab_is_reused_only_once_the_caller_lets_go_of_its_rows():
    import gc

    worker = _Worker([_forward([[1, 2]])])
    region = worker._specshim_region = HostRegion()

    def fetch() -> list[torch.Tensor]:
        reply = state_transport.send(worker, worker._captured_states, [(0, 0, 2)])
        return _received(reply)

    kept = fetch()[0][0:2].clone()  # the caller keeps one clone of the first call
    copy = kept.clone()
    worker._captured_states = _states([_forward([[7, 8]])])
    gc.collect()
    held = fetch()  # the first slab is not free: a second one
    assert len(region.slabs) == 2 and torch.equal(kept, copy)
    del kept, held
    gc.collect()
    fetch()
    assert len(region.slabs) == 2  # both were free again: one was reused
    plain = pickle.loads(pickle.dumps(fetch()[0]))  # a layer pickles as a tensor
    assert type(plain) is torch.Tensor
    region.close()


def test_a_free_slab_too_small_is_retired_and_the_main_process_drops_it():
    import gc

    worker = _Worker([_forward([[1, 2]])])
    region = worker._specshim_region = HostRegion()
    _received(state_transport.send(worker, worker._captured_states, [(0, 0, 2)]))
    small = region.slabs[0].path
    assert small in _handed_states._ATTACHED
    gc.collect()
    worker._captured_states = _states([_forward([list(range(3000))])])
    bigger = _received(
        state_transport.send(worker, worker._captured_states, [(0, 0, 3000)])
    )
    assert bigger[0].shape == (3000, 2) and len(region.slabs) == 1
    assert small not in _handed_states._ATTACHED
    region.close()


def test_a_caller_holding_every_slab_gets_the_fallback_with_one_warning(
    monkeypatch, caplog
):
    monkeypatch.setattr(_shared_states, "MAX_SLABS", 2)
    worker = _Worker([_forward([[1, 2]])])
    region = worker._specshim_region = HostRegion()
    held = [
        _received(state_transport.send(worker, worker._captured_states, [(0, 0, 2)]))
        for _ in range(4)
    ]
    assert len(region.slabs) == 2
    assert all(torch.equal(h[0], held[0][0]) for h in held)
    assert caplog.text.count("still holds the captured states of 2") == 1
    region.close()


def test_a_descriptor_of_an_overwritten_fetch_refuses_to_be_read():
    import gc

    worker = _Worker([_forward([[1, 2]])])
    reply = state_transport.send(worker, worker._captured_states, [(0, 0, 2)])
    stale = pickle.dumps(reply)
    del reply
    pickle.loads(stale)  # read and let go: the slab is free again
    gc.collect()
    _received(state_transport.send(worker, worker._captured_states, [(0, 0, 2)]))
    assert len(worker._specshim_region.slabs) == 1
    rows = pickle.loads(stale)[0]
    assert isinstance(rows, _handed_states.Unattached)
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
    held = worker._specshim_region.slabs[0].path
    assert held in _handed_states._ATTACHED
    other = _Worker([_forward([[1, 2]])])
    other._specshim_region = HostRegion()
    other._specshim_region.prefix = "specshim-states-999999999-beef"
    monkeypatch.setattr(
        _handed_states, "pid_alive", lambda pid: pid != os.getpid()
    )  # as if the first worker had exited
    _received(state_transport.send(other, other._captured_states, [(0, 0, 2)]))
    assert held not in _handed_states._ATTACHED
    assert other._specshim_region.slabs[0].path in _handed_states._ATTACHED
    worker._specshim_region.close()
    other._specshim_region.close()


def test_no_threads_are_lent_where_the_workers_compute_on_the_cpu():
    from vllm.platforms import current_platform

    from specshim.patches import _threads

    assert current_platform.is_cpu()  # this tier runs vLLM's CPU build
    assert _threads.copy_threads() == 1


def test_a_closed_generators_slabs_are_unmapped_unless_held():
    import gc

    worker = _Worker([_forward([[1, 2]])])
    region = worker._specshim_region = HostRegion()
    first = _received(
        state_transport.send(worker, worker._captured_states, [(0, 0, 2)])
    )
    kept = first[0][0:2].clone()
    want = kept.clone()
    del first
    gc.collect()
    dropped = _received(
        state_transport.send(worker, worker._captured_states, [(0, 0, 2)])
    )
    del dropped
    gc.collect()
    paths = [slab.path for slab in region.slabs]
    assert len(paths) == 2 and all(p in _handed_states._ATTACHED for p in paths)
    _handed_states.forget([os.getpid()])  # the workers' pid: here, this process
    assert not set(paths) & set(_handed_states._ATTACHED)
    region.close()
    gc.collect()
    assert _mapped(region.prefix) == 1  # the slab under the clone still held
    assert torch.equal(kept, want)
    del kept
    gc.collect()
    assert _mapped(region.prefix) == 0


def _mapped(prefix: str) -> int:
    """This process's mappings of files whose name starts with ``prefix``."""
    with open("/proc/self/maps") as maps:
        return sum(prefix in line for line in maps)


def test_a_cap_on_shared_memory_sends_what_does_not_fit_the_other_way(
    monkeypatch, caplog
):
    monkeypatch.setenv("SPECSHIM_SHM_MIB", "1")
    worker = _Worker([_forward([list(range(10))])])
    region = worker._specshim_region = HostRegion()
    small = _received(
        state_transport.send(worker, worker._captured_states, [(0, 0, 10)])
    )
    assert len(region.slabs) == 1
    big = list(range(300_000))  # 2 layers x 300,000 rows x 4 bytes: over 1 MiB
    worker._captured_states = _states([_forward([big])])
    for _ in range(2):
        rows = _received(
            state_transport.send(worker, worker._captured_states, [(0, 0, 300_000)])
        )
        assert torch.equal(rows[1], worker._captured_states[1][0])
    assert len(region.slabs) == 1 and region.failure is None
    assert caplog.text.count("SPECSHIM_SHM_MIB=1 leaves no room") == 1
    assert "copied twice more" in caplog.text
    del small
    region.close()


def test_no_shared_memory_at_all_is_a_lasting_fallback(monkeypatch):
    monkeypatch.setenv("SPECSHIM_SHM_MIB", "0")
    worker = _Worker([_forward([[1, 2]])])
    region = worker._specshim_region = HostRegion()
    rows = _received(state_transport.send(worker, worker._captured_states, [(0, 0, 2)]))
    assert torch.equal(rows[0], worker._captured_states[0][0])
    assert region.slabs == [] and region.failure.startswith("SPECSHIM_SHM_MIB=0")


@pytest.mark.parametrize("value", ["-1", "64M", "1.5"])
def test_a_cap_that_is_no_whole_number_of_mib_is_refused_in_one_line(
    monkeypatch, value
):
    from specshim._base import UsageError
    from specshim._settings import require_valid_environment

    monkeypatch.setenv("SPECSHIM_SHM_MIB", value)
    with pytest.raises(UsageError, match=f"SPECSHIM_SHM_MIB={value}: give the most"):
        require_valid_environment()
