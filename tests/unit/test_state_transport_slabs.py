"""state-transport without vLLM: the shared region's slabs (reused, retired,
all held), its descriptors, its cleanup (on close, for exited workers, for a
closed generator) and the SPECSHIM_SHM_MIB cap. The layout and the rows that
arrive are in test_state_transport_rows.py."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from specshim import SpecShimError
from specshim.patches._transport import handed_states as _handed_states
from specshim.patches._transport import shared_states as _shared_states
from specshim.patches._transport.shared_states import HostRegion
from specshim.patches.worker import state_transport

from ._transport_helpers import _forward, _received, _states, _Worker


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
