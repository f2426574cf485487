"""state-transport across a fork of the caller: the rows generate() handed
over are each process's own afterwards, as any other memory is (a child
inherits them copy-on-write), and the slab under them goes back to its
worker. Before, they stayed over the shared slab: writes in either process
showed in the other, and the worker overwrote rows the other still read."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import pytest
import torch

from specshim.patches._transport import handed_states as _handed_states
from specshim.patches._transport import private_copy
from specshim.patches._transport.shared_states import HostRegion
from specshim.patches.worker import state_transport
from specshim.testing.forking import exit_status, forked

from ._transport_helpers import _forward, _received, _states, _Worker


def _caller() -> tuple[HostRegion, Callable[[int], list[torch.Tensor]]]:
    """A worker's slabs, and a fetch of one call through them: its two rows a
    layer, cloned as speculators clones them."""
    worker = _Worker([_forward([[1, 2]])])
    region = worker._specshim_region = HostRegion()

    def fetch(seed: int) -> list[torch.Tensor]:
        states = _states([_forward([[seed, seed + 1]])])
        worker._captured_states = [[t + seed for t in layer] for layer in states]
        layers = _received(
            state_transport.send(worker, worker._captured_states, [(0, 0, 2)])
        )
        return [h[0:2].clone() for h in layers]

    return region, fetch


def _over_a_slab(rows: list[torch.Tensor], region: HostRegion) -> bool:
    """Whether ``rows`` are the zero-copy clones over the caller's mapping of
    the slab (the path under test), not copies."""
    import ctypes

    (slab,) = region.slabs
    mapping = _handed_states._ATTACHED[slab.path]
    view = ctypes.c_char.from_buffer(mapping)
    start = ctypes.addressof(view)
    del view
    return all(start <= t.data_ptr() < start + len(mapping) for t in rows)


def test_rows_held_across_a_fork_are_each_process_own():
    region, fetch = _caller()
    held = fetch(20)
    want = [t.clone() for t in held]
    assert _over_a_slab(held, region)
    wrote_r, wrote_w = os.pipe()
    go_r, go_w = os.pipe()

    def work() -> bool:
        held[0].add_(1)  # the child writes in place: its own copy only
        os.write(wrote_w, b"w")
        os.read(go_r, 1)  # the parent has written and fetched again
        return torch.equal(held[0], want[0] + 1) and torch.equal(held[1], want[1])

    with forked(work) as pid:
        os.close(wrote_w)  # a child gone before it wrote: end of file, not a hang
        os.close(go_r)
        assert os.read(wrote_r, 1) == b"w", "the child ended before it wrote"
        assert torch.equal(held[0], want[0])  # the child's write did not show here
        held[1].mul_(3)  # nor does the parent's show in the child
        fetch(99)  # the worker writes its slab again: it was released
        assert len(region.slabs) == 1
        assert torch.equal(held[0], want[0]) and torch.equal(held[1], want[1] * 3)
        os.write(go_w, b"g")
        assert exit_status(pid) == 0, (
            "the child saw the parent's or the worker's writes"
        )
    os.close(wrote_r)
    os.close(go_w)
    region.close()


def test_a_child_letting_go_of_its_copies_releases_nothing_of_the_parent():
    region, fetch = _caller()
    held = fetch(20)
    want = [t.clone() for t in held]

    def work() -> bool:
        held.clear()
        gc.collect()
        return True

    with forked(work) as pid:
        assert exit_status(pid) == 0
    fetch(99)
    fetch(7)
    assert all(torch.equal(a, b) for a, b in zip(held, want, strict=True))
    region.close()


def test_a_release_comes_only_from_the_process_that_attached():
    region, fetch = _caller()
    fetch(20)
    (path,) = [s.path for s in region.slabs]
    mapping = _handed_states._ATTACHED[path]
    before = bytes(mapping[8:16])
    _handed_states._release(mapping, 12345, os.getpid() + 1)
    assert bytes(mapping[8:16]) == before
    _handed_states._release(mapping, 12345, os.getpid())
    assert int.from_bytes(mapping[8:16], "little") == 12345
    region.close()


def test_where_the_rows_cannot_be_copied_the_slab_is_never_reused(monkeypatch, caplog):
    def refuse(mapping, fd) -> None:
        raise OSError(12, "mmap: Cannot allocate memory")

    monkeypatch.setattr(private_copy, "make_private", refuse)
    region, fetch = _caller()
    held = fetch(20)
    with forked(lambda: True) as pid:
        assert exit_status(pid) == 0
    assert "Cannot allocate memory" in caplog.text  # the copy's own error
    assert "parent and child share it" in caplog.text
    del held
    gc.collect()
    fetch(99)  # the first slab is never released: the worker makes another
    assert len(region.slabs) == 2
    region.close()


def test_a_mapping_made_private_keeps_its_bytes_and_leaves_the_file(tmp_path):
    import mmap

    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 40)  # not a whole number of pages
    fd = os.open(path, os.O_RDWR)
    mapping = mmap.mmap(fd, 0)
    os.close(fd)
    private_copy.make_private(mapping)
    assert mapping[:] == bytes(range(256)) * 40
    mapping[0:4] = b"abcd"
    assert path.read_bytes()[:4] == bytes(range(4))  # the file no longer changes
    with open(path, "r+b") as f:
        f.write(b"zz")
    assert mapping[:4] == b"abcd"  # nor is it read
    mapping.close()


@pytest.fixture(autouse=True)
def _no_leases_left():
    yield
    gc.collect()


def test_where_the_move_fails_after_unmapping_the_file_is_mapped_back(
    tmp_path, monkeypatch
):
    """mremap with MREMAP_FIXED unmaps the range first; where it fails after
    that, the rows' file is mapped back at their address, not left unmapped
    under the caller's tensors."""
    import ctypes
    import mmap

    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 64)
    fd = os.open(path, os.O_RDWR)
    mapping = mmap.mmap(fd, 0)
    real = private_copy._libc()

    class FailingMove:
        def __getattr__(self, name):
            return getattr(real, name)

        def mremap(self, old, size, new_size, flags, address):
            real.munmap(address, new_size)  # the kernel's first step
            ctypes.set_errno(12)
            return private_copy._FAILED

    monkeypatch.setattr(private_copy, "_libc", FailingMove)
    with pytest.raises(OSError, match="mremap"):
        private_copy.make_private(mapping, fd)
    assert mapping[:] == bytes(range(256)) * 64  # mapped back: readable
    os.close(fd)
    mapping.close()


def test_slabs_let_go_from_the_garbage_collector_during_a_fork_do_not_deadlock():
    """A generator collected while the fork's handler holds its lock lets its
    slabs go on the same thread (the collector runs where memory is taken)."""
    import threading

    def collect_during_fork() -> None:
        with _handed_states._FORKING:  # as the handler holds it
            _handed_states.forget([])  # what a collected generator's finalizer does
            _handed_states._let_go("/dev/shm/specshim-states-1-a-b")

    thread = threading.Thread(target=collect_during_fork, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "letting slabs go under the fork's lock hung"
