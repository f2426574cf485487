"""vLLM's prefix cache, as issue 47's proof (``rows.match_tails``) reads it,
on the real CPU build: with prefix caching on, a request whose first blocks
are cached is computed from the first uncached whole block on, its rows
carrying their true positions; ``match_tails`` ties each such run to its
sequence and the number of rows served. Unguarded, speculators slices those
short runs as if whole: the misaligned rows the guard refuses today.
Extended: one generator start, for a reading no flag uses yet."""

from __future__ import annotations

import pytest

from .checks import found_by

pytestmark = pytest.mark.extended


def test_served_blocks_leave_runs_match_tails_ties_to_their_sequences(tiny_model_dir):
    found = found_by("tests.e2e.prefix_cache_runs", str(tiny_model_dir("llama")))
    block, (first, second, third) = found["block"], found["calls"]
    assert found["caching"] is True
    served = 2 * block  # the shared 2.5 blocks: two whole ones are cached
    # Call 1 computes everything: two whole runs.
    assert [r[2] for r in first["runs"]] == [0, 0] and first["strays"] == []
    assert first["returned"] == first["lengths"]
    # Call 2: both sequences served their two shared blocks, computed from
    # there on (true positions), and each run is tied to its own sequence.
    tails = [n - served for n in second["lengths"]]
    assert second["runs"] == [[0, tails[0], served], [tails[0], sum(tails), served]]
    assert second["positions"][: tails[0]] == list(range(served, second["lengths"][0]))
    assert second["strays"] == [] and second["untold"] == []
    # Unguarded, speculators sliced the short capture as if whole: misaligned.
    assert second["returned"] == [sum(tails), 0]
    # Call 3 repeats a sequence of call 2: served from the cache again, though
    # speculators aborted its request (freed blocks stay cached).
    assert third["runs"] == [[0, third["lengths"][0] - served, served]]
