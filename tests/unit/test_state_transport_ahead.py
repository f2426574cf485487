"""state-transport's slab made ahead: where the caller holds every slab that
fits, the next call's slab is made on a thread of its own and taken by that
call; never where a free one fits, never past the cap, silent where it
fails, and removed when its worker was killed before using it."""

from __future__ import annotations

import errno
import fcntl
import gc
import os

import torch

from specshim.patches._transport import handed_states as _handed_states
from specshim.patches._transport import host_slabs as _host_slabs
from specshim.patches._transport import shared_states as _shared_states
from specshim.patches._transport.shared_states import HostRegion

from ._transport_helpers import _fetch, _forward, _Worker


def _ahead_worker(directory: str | None = None) -> tuple[_Worker, HostRegion]:
    worker = _Worker([_forward([[1, 2, 3]])])
    region = worker._specshim_region = HostRegion(directory or "/dev/shm")
    region.make_ahead = True  # as where the states are pinned (a GPU)
    return worker, region


def test_a_caller_holding_its_slabs_gets_the_next_one_made_ahead():
    worker, region = _ahead_worker()
    held = [_fetch(worker, 1)]
    made = region.ahead
    assert made is not None  # the caller holds the only slab
    made.join()
    held.append(_fetch(worker, 2))
    assert made.paths[0] in [s.path for s in region.slabs] and len(region.slabs) == 2
    assert made.paths[0] in _handed_states._ATTACHED  # the second call's rows
    assert region.ahead is not None  # still every slab held: one more ahead
    held.append(_fetch(worker, 3))
    assert len(region.slabs) == 3
    copies = [[layer.clone() for layer in rows] for rows in held]
    for seed in (4, 5):  # the rows already handed over stay as they were
        held.append(_fetch(worker, seed))
    for rows, copy in zip(held, copies, strict=False):
        assert all(torch.equal(a, b) for a, b in zip(rows, copy, strict=True))
    region.close()


def test_none_is_made_ahead_where_a_free_slab_fits():
    worker, region = _ahead_worker()
    _fetch(worker, 1)  # the only slab, just written: one is made ahead
    gc.collect()
    for seed in range(2, 8):  # the caller lets go of each call's rows
        _fetch(worker, seed)
        gc.collect()
        assert region.ahead is None
    assert len(region.slabs) == 2
    region.close()


def test_none_is_made_ahead_past_the_cap(monkeypatch):
    worker, region = _ahead_worker()
    monkeypatch.setattr(region, "limit", 2 * _shared_states.slab_size(4096 * 2))
    held = [_fetch(worker, 1)]
    assert region.ahead is not None  # room for one more
    held.append(_fetch(worker, 2))
    assert region.ahead is None and len(region.slabs) == 2
    region.close()


def test_a_slab_that_cannot_be_made_ahead_is_made_by_the_call_silently(
    monkeypatch, caplog
):
    made = []

    class Refusing(_host_slabs.Slab):
        def __init__(self, path: str, size: int) -> None:
            made.append(path)
            if len(made) == 2:  # the one made ahead
                raise OSError(errno.ENOSPC, "No space left on device")
            super().__init__(path, size)

    monkeypatch.setattr(_host_slabs, "Slab", Refusing)
    worker, region = _ahead_worker()
    held = [_fetch(worker, 1)]
    region.ahead.join()
    assert region.ahead.take(wait=False) == ([], True)  # none made ahead
    held.append(_fetch(worker, 2))  # made here instead
    assert len(made) >= 3 and len(region.slabs) == 2
    assert caplog.text == ""
    assert not os.path.exists(made[1])
    region.close()


def test_a_killed_workers_slab_made_ahead_is_removed(tmp_path):
    worker, region = _ahead_worker(str(tmp_path))
    held = _fetch(worker, 1)
    region.ahead.join()
    assert len(os.listdir(tmp_path)) == 1  # attached ones are unlinked already
    for slab in region.ahead.made:  # as the worker's death lets go of them
        fcntl.flock(slab.fd, fcntl.LOCK_UN)
    _handed_states.forget([os.getpid()])  # as when the worker is gone
    assert os.listdir(tmp_path) == []
    del held
    region.close()


def test_a_slab_whose_lock_is_held_is_kept_whatever_its_pid(tmp_path):
    """Under --ipc=host, /dev/shm is shared with other PID namespaces: a file
    named with a pid this process thinks gone may be a live worker's, which
    holds its lock."""
    worker, region = _ahead_worker(str(tmp_path))
    held = _fetch(worker, 1)
    region.ahead.join()
    _handed_states.forget([os.getpid()])
    assert len(os.listdir(tmp_path)) == 1
    del held
    region.close()


def test_a_slab_file_is_locked_before_its_name_appears(monkeypatch):
    """The lock is all that tells a live worker's file from a dead one's
    where pids repeat (--ipc=host): a sweep run the moment the worker takes
    its lock must not find the file, and once it has its name it is locked."""
    from specshim.patches._transport import slab as _slab

    path = os.path.join(_slab.DIRECTORY, f"{_slab.PREFIX}-{os.getpid()}-t-{id(_slab)}")
    flock, swept = fcntl.flock, []

    def sweeping_flock(fd, operation):
        if operation == fcntl.LOCK_SH:
            swept.append(_slab.remove_unlocked(path))
        return flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", sweeping_flock)
    slab = _host_slabs.Slab(path, 8192)
    try:
        assert swept == [None], "a sweep found the new file unlocked and removed it"
        assert os.path.exists(path) and _slab.remove_unlocked(path) is None
    finally:
        slab.close()
    assert not os.path.exists(path)
