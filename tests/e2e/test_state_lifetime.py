"""What ``generate()`` hands over stays the caller's, on every path and
through whatever the caller does with it (issue 44): a randomized caller, the
generators' slabs unmapped when they close, and ``extract`` in a container
without room for slabs."""

from __future__ import annotations

import gc
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from specshim import close
from specshim._closing import worker_pids
from specshim.testing.tiny_models import WIDE_LAYERS

from .conftest import make_generator
from .lifetime import Lifetime
from .ownership import slab_bytes, slab_files

pytestmark = pytest.mark.e2e

STEPS = 200


def run_lifetime(open_generator, examples: int = 2, steps: int = 120) -> None:
    """``Lifetime`` over at least ``STEPS`` rules, on generators
    ``open_generator`` builds; every one of them closed at the end, and
    nothing of theirs left mapped or in /dev/shm once nothing is held."""
    Lifetime.open = open_generator
    Lifetime.opened, Lifetime.largest, Lifetime.seen = [], {}, []
    Lifetime.checks = Lifetime.examples = Lifetime.overflows = Lifetime.reopens = 0
    Lifetime.forks = 0
    try:
        run_state_machine_as_test(
            Lifetime,
            settings=settings(
                max_examples=examples,
                stateful_step_count=steps,
                deadline=None,
                database=None,
                # No shrinking: the generators and counters live across
                # examples, so a replay is not the same run (and each costs
                # forward passes); the failing steps are printed as they ran.
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            ),
        )
    finally:
        for generator in Lifetime.opened:
            close(generator)
        Lifetime.opened.clear()
    gc.collect()
    every = [pid for pids in Lifetime.largest for pid in pids]
    assert slab_bytes(every) == 0 and slab_files(every) == []
    print(
        f"lifetime: {Lifetime.steps()} steps in {Lifetime.examples} examples, "
        f"{1 + Lifetime.reopens} generators, {Lifetime.forks} forks, largest reply "
        f"{max(Lifetime.largest.values()) / 2**20:.1f} MiB"
    )
    assert Lifetime.steps() >= STEPS, f"only {Lifetime.steps()} steps ran"
    assert Lifetime.reopens >= 1 and Lifetime.overflows >= 1 and Lifetime.forks >= 1
    paths = {(mode, size) for mode, size, _ in Lifetime.seen}
    for mode in ("shared", "fallback", "pickled"):
        assert (mode, "out of band") in paths, f"no out-of-band reply went {mode}"
    held = [
        seen for seen in Lifetime.seen if seen[0] == "shared" and seen[2] == "queue"
    ]
    assert held, (
        f"no call found every slab held (the fallback): {Counter(Lifetime.seen)}"
    )


def test_what_generate_returns_stays_the_callers_whatever_it_does(tiny_model_dir):
    path = str(tiny_model_dir("llama_wide"))
    run_lifetime(lambda: make_generator(path, 1, layer_ids=WIDE_LAYERS))


def test_extract_without_room_for_slabs_writes_what_the_slabs_write(
    tmp_path, tiny_model_dir
):
    """A container's small /dev/shm, made by ``SPECSHIM_SHM_MIB``: the batches
    that find no room (layers of 1 MiB and more among them, which vLLM's queue
    reads from its ring) travel through the queue, and the files are bit for
    bit those of a run with room. The run says why, once, and what it costs."""
    import json
    import os
    import random
    import subprocess

    from .checks import assert_same_files
    from .test_extract import _command, _files

    rng = random.Random(44)
    lengths = [rng.choice([30, 80, 700, 900]) for _ in range(12)]
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(
            json.dumps({"input_ids": [rng.randrange(300) for _ in range(n)]}) + "\n"
            for n in lengths
        )
    )
    model = tiny_model_dir("llama")
    runs = {}
    # The first batch's slab takes 4 MiB, the others under 3: with 3, the
    # first travels through the queue and the rest through slabs.
    for name, cap in (("room", None), ("cramped", "3")):
        env = {k: v for k, v in os.environ.items() if k != "SPECSHIM_SHM_MIB"}
        if cap:
            env["SPECSHIM_SHM_MIB"] = cap
        run = subprocess.run(
            _command(model, data, tmp_path / name),
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        runs[name] = run.stderr
    assert "leaves no room" not in runs["room"]
    warned = [line for line in runs["cramped"].splitlines() if "leaves no room" in line]
    assert len(warned) == 1, warned
    assert "SPECSHIM_SHM_MIB=3" in warned[0] and "copied twice more" in warned[0]
    assert_same_files(
        _files(tmp_path / "room"), _files(tmp_path / "cramped"), len(lengths)
    )


@pytest.mark.extended
def test_twenty_generators_closed_in_one_process_leave_nothing_behind(
    tiny_model_dir,
):
    """Each closed generator's slabs are unmapped and its files gone, but for
    the calls whose states the caller still holds, which stay readable and
    equal; once those go too, nothing of any of them is mapped."""
    import random

    import torch

    from .ownership import assert_left_nothing, batch_of

    path = str(tiny_model_dir("llama"))
    rng = random.Random(20)
    kept, every = [], []
    for round_ in range(20):
        generator = make_generator(path, 1)
        pids = worker_pids(generator.executor)
        every += pids
        results = [generator.generate(batch_of(rng, 40, 30)) for _ in range(3)]
        if round_ % 5 == 0:  # the caller keeps one call's states
            states = results[0][0]["hidden_states"][0]
            kept.append((states, states.clone()))
            del states
        close(generator)
        del generator, results
        gc.collect()
        if round_ % 5:
            assert_left_nothing(pids)
        else:
            assert slab_files(pids) == []
            assert 0 < slab_bytes(pids), "the held call's slab was unmapped"
    assert all(torch.equal(states, copy) for states, copy in kept)
    kept.clear()
    assert_left_nothing(every)
