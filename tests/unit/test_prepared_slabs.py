"""Slabs made before the first call (``prepared-slabs``): the worker makes
as many as it is asked for, sized for the rows it is told, on a thread of
their own; calls take them instead of making their own (waiting for one
still being made), within the cap; a dead worker's are removed by the main
process, and those of a run killed whole by the next run's worker; and
``extract`` asks for one per batch in flight, sized from its first batch."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from specshim.job.extract import command as _extract
from specshim.job.extract.command import extract
from specshim.job.extract.writer import IN_FLIGHT
from specshim.patches._transport import handed_states as _handed_states
from specshim.patches._transport import host_slabs as _host_slabs
from specshim.patches._transport import shared_states as _shared_states
from specshim.patches._transport.early_copies import stride_of
from specshim.patches._transport.shared_states import HostRegion, slab_size
from specshim.patches._transport.slab import files_of
from specshim.patches.worker import capture_hooks, prepared_slabs

from ._pipeline_helpers import FakeGenerator, _jsonl, _options
from ._transport_helpers import _fetch, _forward, _Worker

CALL = 2 * 4096 * 2  # what _fetch's call takes: two layers of 3 rows, paged


def _counting(monkeypatch, gate: threading.Event | None = None) -> list[str]:
    """Every slab made, by path; those made on the thread wait for ``gate``."""
    made: list[str] = []

    class Counted(_host_slabs.Slab):
        def __init__(self, path: str, size: int) -> None:
            if gate is not None and threading.current_thread().name.endswith("ahead"):
                assert gate.wait(10)
            made.append(path)
            super().__init__(path, size)

    monkeypatch.setattr(_host_slabs, "Slab", Counted)
    return made


def test_calls_take_the_prepared_slabs_and_make_none_while_they_last(
    tmp_path, monkeypatch
):
    made = _counting(monkeypatch)
    worker = _Worker([_forward([[1, 2, 3]])])
    region = worker._specshim_region = HostRegion(str(tmp_path))
    assert region.prepare(CALL, 3, None) == 3
    prepared = list(region.ahead.paths)
    held = [_fetch(worker, seed) for seed in (1, 2, 3)]  # the caller keeps all
    assert made == prepared and sorted(s.path for s in region.slabs) == sorted(made)
    assert region.ahead is None  # all three taken
    held.append(_fetch(worker, 4))  # a fourth held call: made by the call
    assert len(made) == 4 and made[3] not in prepared
    copies = [[layer.clone() for layer in rows] for rows in held]
    for rows, copy in zip(held, copies, strict=True):  # none overwritten
        assert all(torch.equal(a, b) for a, b in zip(rows, copy, strict=True))
    region.close()
    assert os.listdir(tmp_path) == []


def test_a_call_waits_for_a_slab_still_being_made_rather_than_make_its_own(
    tmp_path, monkeypatch
):
    gate = threading.Event()
    made = _counting(monkeypatch, gate)
    worker = _Worker([_forward([[1, 2, 3]])])
    region = worker._specshim_region = HostRegion(str(tmp_path))
    region.prepare(CALL, 2, None)
    prepared = list(region.ahead.paths)
    got: list[list[torch.Tensor]] = []
    call = threading.Thread(target=lambda: got.append(_fetch(worker, 1)))
    call.start()
    call.join(0.3)
    assert call.is_alive() and made == []  # waiting, not making its own
    gate.set()
    call.join(10)
    assert got and made[0] == prepared[0]
    region.close()
    assert made == prepared  # the two prepared, none made by the call


def test_no_more_are_prepared_than_the_cap_and_max_slabs_allow(tmp_path, monkeypatch):
    region = HostRegion(str(tmp_path))
    monkeypatch.setattr(region, "limit", 2 * slab_size(CALL) + 1)
    assert region.prepare(CALL, 5, None) == 2
    assert region.prepare(CALL, 5, None) == 0  # one batch at a time
    region.close()
    assert len(region.slabs) == 0 and os.listdir(tmp_path) == []
    region = HostRegion(str(tmp_path))
    assert region.prepare(CALL, 50, None) == _shared_states.MAX_SLABS
    region.close()


def _extension(tmp_path) -> SimpleNamespace:
    config = SimpleNamespace(get_hidden_size=lambda: 64, dtype=torch.bfloat16)
    extension = SimpleNamespace(model_config=config, device=torch.device("cpu"))
    extension._specshim_region = HostRegion(str(tmp_path))
    return extension


def test_the_worker_prepares_what_the_variables_ask_on_rank_0_only(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(capture_hooks, "tp_rank", lambda: 0)
    extension = _extension(tmp_path)
    assert prepared_slabs.prepare(extension, 4) == 0  # nothing asked
    monkeypatch.setenv("SPECSHIM_SLAB_ROWS", "100")
    monkeypatch.setenv("SPECSHIM_SLABS", "2")
    assert prepared_slabs.prepare(extension, 4) == 2
    region = extension._specshim_region
    region._adopt_ahead()  # waits for both
    want = slab_size(stride_of(100, 64 * 2) * 4)  # 4 layers of bfloat16 rows
    assert [s.base.numel() for s in region.slabs] == [want, want]
    region.close()
    extension = _extension(tmp_path)
    monkeypatch.setattr(capture_hooks, "tp_rank", lambda: 1)
    assert prepared_slabs.prepare(extension, 4) == 0  # rank 1 captures nothing
    monkeypatch.setattr(capture_hooks, "tp_rank", lambda: 0)
    monkeypatch.setenv("SPECSHIM_SLABS", "0")
    assert prepared_slabs.prepare(extension, 4) == 0  # turned off
    assert os.listdir(tmp_path) == []


def test_the_main_process_removes_the_slabs_of_a_worker_that_died():
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(dead.stdout)
    left = files_of(pid).replace("*", "0a0a0a0a-1b1b1b1b")
    with open(left, "wb") as handle:
        handle.write(b"x")
    _handed_states.forget([pid])
    assert not os.path.exists(left)
    alive = files_of(os.getpid()).replace("*", "0a0a0a0a-1b1b1b1b")
    with open(alive, "wb") as handle:
        handle.write(b"x")
    _handed_states.forget([os.getpid()])  # alive: its own close removes them
    assert os.path.exists(alive)
    os.unlink(alive)


def test_extract_asks_for_one_slab_a_batch_in_flight_sized_from_its_first(
    tmp_path, tiny_model_dir, monkeypatch
):
    seen: list[tuple[str | None, str | None]] = []

    def make(plan):
        seen.append(
            (os.environ.get("SPECSHIM_SLAB_ROWS"), os.environ.get("SPECSHIM_SLABS"))
        )
        return FakeGenerator()

    monkeypatch.setattr(_extract, "_make_generator", make)
    monkeypatch.setattr(_extract, "on_cpu", lambda: False)
    monkeypatch.delenv("SPECSHIM_SLAB_ROWS", raising=False)
    monkeypatch.delenv("SPECSHIM_SLABS", raising=False)
    model = tiny_model_dir("llama")
    rows = [{"input_ids": list(range(1, n + 2))} for n in range(8)]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    extract(_options(model, data, tmp_path / "out"))  # batches of 4
    assert seen == [(str(1 + 2 + 3 + 4), str(IN_FLIGHT))]
    assert "SPECSHIM_SLAB_ROWS" not in os.environ  # only while it starts
    monkeypatch.setenv("SPECSHIM_SLABS", "0")  # the user's choice stands
    extract(_options(model, data, tmp_path / "out2"))
    assert seen[1] == (None, "0")
    # --reuse-prefixes starts the engine before its plan: from the feed's
    # first batch all the same.
    monkeypatch.delenv("SPECSHIM_SLABS")
    monkeypatch.setattr(_extract.reuse, "planned", lambda todos, *_: (todos, None))
    extract(_options(model, data, tmp_path / "out3", reuse_prefixes=True))
    assert seen[2] == (str(1 + 2 + 3 + 4), str(IN_FLIGHT))


def test_a_new_region_removes_the_slab_files_a_killed_run_left(tmp_path):
    """A worker holds a lock on each of its slabs while it lives; a file no
    process holds a lock on and untouched for STALE_S is a killed run's, and
    the next region removes it. A live worker's, a fresh one and anything
    else stay."""
    old = time.time() - _host_slabs.STALE_S - 60

    def left(name: str, when: float) -> str:
        path = os.path.join(tmp_path, name)
        with open(path, "wb") as handle:
            handle.write(b"x" * 4096)
        os.utime(path, (when, when))
        return path

    dead = left("specshim-states-999999-0a0a0a0a-1b1b1b1b", old)
    fresh = left("specshim-states-999999-0a0a0a0a-2c2c2c2c", time.time())
    other = left("another-program-file", old)
    live = _host_slabs.Slab(os.path.join(tmp_path, "specshim-states-1-aa-bb"), 8192)
    os.utime(live.path, (old, old))
    region = HostRegion(str(tmp_path))
    assert not os.path.exists(dead)
    assert all(map(os.path.exists, (fresh, other, live.path)))
    fd = live.fd
    live.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # the lock's descriptor goes with the slab
    region.close()
