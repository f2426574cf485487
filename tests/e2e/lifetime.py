"""A randomized caller of ``generate()``: ``Lifetime`` is a ``hypothesis`` state
machine that calls ``generate()`` with replies of every size (slab, fallback,
over the queue's chunk) and does to the results what callers do, checking
every held tensor against what it held at return; the CPU tier and the GPU
tier run it.
"""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from specshim import close
from specshim._closing import worker_pids
from specshim.patches._transport.shared_states import MAX_SLABS, slab_size
from specshim.testing.forking import exit_status, forked
from specshim.testing.worker_probes import use_transport

from .ownership import (
    MODES,
    QUEUE_CHUNK,
    RING_BUFFER,
    SLAB_NAME,
    assert_callers_own,
    batch_of,
    reply_rows,
    slab_bytes,
    slab_files,
    slab_mappings,
)


class Held:
    """A tensor the caller keeps, and how to read what it must hold: each
    returned layer is a root with a mirror cloned at return; slices and views
    of it read the mirror the same way, and writes go to both."""

    def __init__(self, tensor: torch.Tensor, root: int, read: Callable) -> None:
        self.tensor, self.root, self.read = tensor, root, read


def _write(tensor: torch.Tensor) -> None:
    """Change every element of ``tensor`` in place (a caller's write)."""
    if tensor.dtype == torch.int16:
        tensor.bitwise_xor_(0x5A5A)
    else:
        tensor.mul_(-1)


class Lifetime(RuleBasedStateMachine):
    """A caller of ``generate()``: holds, slices, views, clones, writes and drops
    what it got, closes the generator and opens another, while every held
    tensor must keep what it held. ``Lifetime.open`` builds a generator."""

    open: Callable[[], Any]  # set by the test
    longest = 1000  # tokens a sequence may have (under max_model_len)
    opened: list[Any] = []  # the live generator, across examples
    largest: dict[tuple[int, ...], int] = {}  # workers -> their largest reply
    seen: list[tuple[str, str, str]] = []  # (transport, size, where the rows lay)
    checks = 0  # the held tensors checked: after each step and each start
    examples = 0
    overflows = 0
    reopens = 0
    forks = 0  # children forked while the caller held results

    def __init__(self) -> None:
        super().__init__()
        if not Lifetime.opened:
            Lifetime.opened.append(Lifetime.open())
        Lifetime.examples += 1
        self.rng = random.Random(0)  # the tokens: the same on a replay
        self.turns: dict[str, int] = {}
        self.overflowed = self.reopened = False
        self.held: list[Held] = []
        self.aside: list[Held] = []  # checked, never drawn from
        self.mirrors: list[torch.Tensor] = []

    @classmethod
    def steps(cls) -> int:
        """Rules run so far, over every example."""
        return cls.checks - cls.examples

    @property
    def generator(self) -> Any:
        return Lifetime.opened[-1]

    def _generate(
        self, size: str, rows: int, mode: str | None = None, aside: bool = False
    ) -> None:
        """One call, on the transport ``mode`` (by turns where None: each
        size meets every path, whatever order hypothesis picks)."""
        turn = self.turns[size] = self.turns.get(size, -1) + 1
        mode = mode or MODES[turn % len(MODES)]
        self.generator.executor.collective_rpc(use_transport, args=(mode,))
        results = self.generator.generate(batch_of(self.rng, rows, self.longest))
        pids = tuple(worker_pids(self.generator.executor))
        paths = assert_callers_own(results, list(pids))
        on_slab = all(os.path.basename(p).startswith(SLAB_NAME) for p in paths)
        Lifetime.seen.append((mode, size, "slab" if on_slab else "queue"))
        layer = sum(r["hidden_states"][0].nbytes for r in results)
        reply = len(self.generator.layer_ids) * -(-layer // 4096) * 4096  # as sent
        Lifetime.largest[pids] = max(Lifetime.largest.get(pids, 0), reply)
        into = self.aside if aside else self.held
        for result in results:
            for tensor in result["hidden_states"]:
                self.mirrors.append(tensor.clone())
                into.append(Held(tensor, len(self.mirrors) - 1, lambda m: m))

    def _rows(self, reply_bytes: int) -> int:
        layers = len(self.generator.layer_ids)
        return reply_rows(self.generator, reply_bytes, layers)

    @rule(rows=st.integers(1, 64))
    def generate_small(self, rows: int) -> None:
        self._generate("small", rows)

    @rule(share=st.floats(1.05, 2.5))
    def generate_out_of_band(self, share: float) -> None:
        """Layers of 1 MiB and more in a reply under the queue's chunk: sent
        out of band, read from the ring where they are not on a slab."""
        layers = len(self.generator.layer_ids)
        assert layers * 2.5 * RING_BUFFER < QUEUE_CHUNK
        self._generate("out of band", self._rows(int(layers * share * RING_BUFFER)))

    @rule()
    def generate_over_the_chunk(self) -> None:
        """A reply over the queue's chunk leaves through zmq frames; only the
        fallback sends its rows there (a slab's descriptor is small). Once an
        example: each costs seconds of forward on a CPU.
        Its states are held aside, never picked for the other rules, and
        the cap is checked here, not as a precondition: what hypothesis may
        draw must not depend on what earlier examples did."""
        if self.overflowed:
            return
        self.overflowed = True
        Lifetime.overflows += 1
        rows = self._rows(QUEUE_CHUNK + RING_BUFFER)
        self._generate("over the chunk", rows, "fallback", aside=True)

    # Every example starts with each path once (hypothesis runs the
    # ``initialize`` rules first, in a random order; the ``rule``s after them
    # are a random subset, swarm testing, so they alone may miss a path).
    @initialize()
    def hold_every_slab(self) -> None:
        """The caller keeps ``MAX_SLABS`` calls' states: the next call finds no
        free slab and takes the fallback."""
        for _ in range(MAX_SLABS + 1):
            self._generate("small", 8, "shared")

    @initialize(share=st.floats(1.05, 2.0))
    def out_of_band_on_every_path(self, share: float) -> None:
        layers = len(self.generator.layer_ids)
        for mode in ("shared", "fallback", "pickled"):
            rows = self._rows(int(layers * share * RING_BUFFER))
            self._generate("out of band", rows, mode)

    @initialize()
    def over_the_chunk(self) -> None:
        self.generate_over_the_chunk()

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def slice_one(self, data: Any) -> None:
        entry = data.draw(st.sampled_from(self.held))
        rows = entry.tensor.shape[0]
        a = data.draw(st.integers(0, rows - 1))
        b = data.draw(st.integers(a + 1, rows))
        read = entry.read
        self.held.append(Held(entry.tensor[a:b], entry.root, lambda m: read(m)[a:b]))

    @precondition(lambda self: self.held)
    @rule(data=st.data(), how=st.sampled_from(["flat", "int16", "numpy", "dlpack"]))
    def view_one(self, data: Any, how: str) -> None:
        entry = data.draw(st.sampled_from(self.held))
        if not entry.tensor.is_contiguous():
            return
        read = entry.read
        if how == "flat":
            view, again = entry.tensor.view(-1), lambda m: read(m).view(-1)
        elif how == "int16":
            view = entry.tensor.view(torch.int16)
            again = lambda m: read(m).view(torch.int16)  # noqa: E731
        elif how == "numpy":
            view = torch.from_numpy(entry.tensor.view(torch.int16).numpy())
            again = lambda m: read(m).view(torch.int16)  # noqa: E731
        else:
            view = torch.from_dlpack(entry.tensor)
            again = read
        self.held.append(Held(view, entry.root, again))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def clone_one(self, data: Any) -> None:
        entry = data.draw(st.sampled_from(self.held))
        copy = entry.tensor.clone()
        self.mirrors.append(entry.read(self.mirrors[entry.root]).clone())
        self.held.append(Held(copy, len(self.mirrors) - 1, lambda m: m))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def write_one(self, data: Any) -> None:
        """The caller writes into what it holds: its aliases see it, nothing
        else does."""
        entry = data.draw(st.sampled_from(self.held))
        for tensor in (entry.tensor, entry.read(self.mirrors[entry.root])):
            _write(tensor)

    @precondition(lambda self: self.held)
    @rule()
    def fork_and_write(self) -> None:
        """A forked child (a DataLoader worker, a multiprocessing child under
        fork) reads everything the caller holds, then writes into all of it:
        the child saw what the caller held, and the caller sees none of the
        child's writes (``check_held``), nor the worker's once the slabs under
        them went back to it at the fork."""

        def work() -> bool:
            entries = self.held + self.aside
            same = all(
                torch.equal(e.tensor, e.read(self.mirrors[e.root])) for e in entries
            )
            for entry in entries:
                _write(entry.tensor)
            return same

        with forked(work) as pid:
            Lifetime.forks += 1
            assert exit_status(pid) == 0, "a forked child read other rows, or hung"

    @precondition(lambda self: self.held)
    @rule(data=st.data(), everything=st.booleans())
    def drop(self, data: Any, everything: bool) -> None:
        if everything:
            self.held.clear()
        else:
            self.held.remove(data.draw(st.sampled_from(self.held)))
        gc.collect()

    @rule()
    def close_and_reopen(self) -> None:
        """Closed, its slabs are unmapped and its files gone but for what the
        caller still holds, which stays readable; then a new generator (at
        most once an example: a start-up costs seconds)."""
        if not self.reopened:
            self._reopen()

    def _reopen(self) -> None:
        self.reopened = True
        Lifetime.reopens += 1
        old = self.generator
        pids = worker_pids(old.executor)
        largest = Lifetime.largest.get(tuple(pids), 0)
        close(old)
        Lifetime.opened.pop()
        del old
        gc.collect()
        self.check_held()
        assert slab_files(pids) == []
        held_roots = {entry.root for entry in self.held + self.aside}
        if not held_roots:
            assert slab_bytes(pids) == 0, "a closed generator's slabs stay mapped"
        assert slab_bytes(pids) <= MAX_SLABS * slab_size(largest)
        Lifetime.opened.append(Lifetime.open())

    @invariant()
    def check_held(self) -> None:
        Lifetime.checks += 1
        for entry in self.held + self.aside:
            want = entry.read(self.mirrors[entry.root])
            assert torch.equal(entry.tensor, want), "a held tensor changed"

    @invariant()
    def slabs_are_bounded(self) -> None:
        """At most ``MAX_SLABS`` slabs of the largest reply's size per
        generator, open or closed, whatever the caller holds."""
        for pids, largest in Lifetime.largest.items():
            mapped = slab_bytes(list(pids))
            assert mapped <= MAX_SLABS * slab_size(largest), (
                f"{mapped} bytes of slabs mapped, largest reply {largest}: "
                + "; ".join(slab_mappings(list(pids)))
            )

    def teardown(self) -> None:
        if not Lifetime.reopens:  # once a run at least, whatever the rules were
            self._reopen()
        if not Lifetime.forks:  # the same (hypothesis may leave a rule out)
            if not self.held:
                self.generate_small(16)
            self.fork_and_write()
            self.check_held()
        self.held.clear()
        self.aside.clear()
        self.mirrors.clear()
        gc.collect()
