"""state-transport without vLLM: the input-order layout of the runs, the rows
that arrive and how they are handed over (shared region or fallback), the
expected order in get_captured_states, the main process's copy threads and the
transport microbenchmark. Slabs, descriptors and the shared-memory cap are in
test_state_transport_slabs.py; the real workers are compared bit for bit in
tests/e2e/test_reference_match.py."""

from __future__ import annotations

import os

import pytest
import torch

from specshim._moved import tally
from specshim.patches._transport import handed_states as _handed_states
from specshim.patches.worker import state_transport

from ._transport_helpers import _forward, _received, _Worker


def test_rows_already_in_input_order_keep_the_capture_order():
    batch = [[5, 6, 7], [1, 2], [5, 6, 7], [9]]
    forwards = [_forward([[5, 6, 7], [1, 2]]), _forward([[5, 6, 7], [9]])]
    assert state_transport.input_order(batch, forwards) is None


def test_runs_are_laid_out_in_input_order_with_the_record_permuted_alike():
    batch = [[5, 6, 7], [1, 2], [5, 6, 7], [9]]
    # Two forwards, each sorted by token count as the V2 runner does.
    forwards = [_forward([[1, 2], [5, 6, 7]]), _forward([[9], [5, 6, 7]])]
    pieces, entries, moved = state_transport.input_order(batch, forwards)
    assert pieces == [(0, 2, 3), (0, 0, 2), (1, 1, 3), (1, 0, 1)]
    assert moved == 4
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


@pytest.mark.parametrize("directory", [None, "/nonexistent-shm"])
def test_what_arrives_is_the_rows_in_the_pieces_order(directory):
    forwards = [_forward([[1, 2, 3], [4]]), _forward([[5, 6]])]
    worker = _Worker(forwards, directory)
    captured = worker._captured_states
    pieces = [(1, 0, 2), (0, 3, 1), (0, 0, 3)]
    before = tally()
    got = _received(state_transport.send(worker, captured, pieces))
    after = tally()  # what extract's closing line reports
    queued = sum(states.numel() * states.element_size() for states in got)
    if directory is None:
        assert after == before | {"slabs": before["slabs"] + 1}
    else:
        assert after == before | {"queued_bytes": before["queued_bytes"] + queued}
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
    from specshim.patches._transport import threads as _threads

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


def test_no_threads_are_lent_where_the_workers_compute_on_the_cpu():
    from vllm.platforms import current_platform

    from specshim.patches._transport import threads as _threads

    assert current_platform.is_cpu()  # this tier runs vLLM's CPU build
    assert _threads.copy_threads() == 1
