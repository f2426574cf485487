"""The library's settings: configure() and configured() on the step-budget and
KV-cache knobs, revert(), and the cheap import with its post-import hooks.
The SPECSHIM_* environment and extract's step budget are in
test_settings_environment.py."""

from __future__ import annotations

import importlib
import json

import pytest

import specshim
from specshim import _hooks
from specshim._base import GENERATOR, SpecShimError

from ._settings_helpers import (
    _fresh_python,
    _generator_module,  # noqa: F401 - the generator_module fixture
)


def test_configure_sets_speculators_constants_and_reset_restores(generator_module):
    before = (
        generator_module.MAX_NUM_SEQS,
        generator_module.MIN_MAX_BATCHED_TOKENS,
        generator_module.CACHE_MEMORY_FRACTION,
    )
    assert before == (32, 8192, 0.2)  # speculators 0.3.0's own values
    state = specshim.configure(
        max_num_seqs=96, max_batched_tokens=40000, cache_memory_fraction=0.5
    )
    assert generator_module.MAX_NUM_SEQS == 96
    assert generator_module.MIN_MAX_BATCHED_TOKENS == 40000
    assert generator_module.CACHE_MEMORY_FRACTION == 0.5
    assert state["max_num_seqs"] == {
        "value": 96,
        "source": "configure()",
        "constant": "MAX_NUM_SEQS",
        "env": "SPECSHIM_MAX_NUM_SEQS",
    }
    # None leaves a setting alone.
    specshim.configure(max_num_seqs=8)
    assert generator_module.MAX_NUM_SEQS == 8
    assert generator_module.MIN_MAX_BATCHED_TOKENS == 40000
    specshim.configure(reset=True)
    assert (
        generator_module.MAX_NUM_SEQS,
        generator_module.MIN_MAX_BATCHED_TOKENS,
        generator_module.CACHE_MEMORY_FRACTION,
    ) == before
    assert specshim.settings()["max_num_seqs"]["source"] == "speculators"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"max_num_seqs": 2.5}, "max_num_seqs must be an integer"),
        ({"max_num_seqs": True}, "max_num_seqs must be a number"),
        ({"max_batched_tokens": "lots"}, "max_batched_tokens must be an integer"),
        ({"cache_memory_fraction": 0}, "cache_memory_fraction must be in (0, 1.0]"),
        ({"cache_memory_fraction": 1.5}, "cache_memory_fraction must be in (0, 1.0]"),
        ({"cache_memory_fraction": float("nan")}, "must be a number"),
    ],
)
def test_configure_rejects_bad_values_and_changes_nothing(
    generator_module, kwargs, needle
):
    with pytest.raises(SpecShimError) as info:
        # A good value beside the bad one must not be applied either.
        specshim.configure(**{"max_batched_tokens": 50000, **kwargs})
    assert needle in str(info.value)
    assert generator_module.MAX_NUM_SEQS == 32
    assert generator_module.MIN_MAX_BATCHED_TOKENS == 8192
    assert generator_module.CACHE_MEMORY_FRACTION == 0.2


def test_import_specshim_loads_no_heavy_modules():
    # The speed goal (< 30 ms) is checked by the benchmark; this guards the
    # cause: none of these may load with ``import specshim``.
    code = (
        "import sys, json; before = set(sys.modules); import specshim\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    done = _fresh_python(code)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    heavy = {
        "torch",
        "vllm",
        "speculators",
        "wrapt",
        "asyncio",
        "importlib.metadata",
        "logging",
        "dataclasses",
        "typing",
        "specshim.patches",
    }
    assert not heavy & loaded, sorted(heavy & loaded)


def test_post_import_hook_fires_after_the_module_body(fake_module):
    name = fake_module("VALUE = 1\n")
    seen = []
    _hooks.when_imported(name, lambda module: seen.append(module.VALUE))
    assert seen == []
    module = importlib.import_module(name)
    assert seen == [1]
    # The module keeps its real loader; a hook on a loaded module fires at once.
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    _hooks.when_imported(name, lambda module: seen.append(module.VALUE + 1))
    assert seen == [1, 2]


def test_post_import_hook_does_not_fire_for_a_failed_import(fake_module):
    name = fake_module("raise ImportError('broken on purpose')\n")
    seen = []
    _hooks.when_imported(name, seen.append)
    with pytest.raises(ImportError, match="broken on purpose"):
        importlib.import_module(name)
    assert seen == []


def test_configured_is_scoped_and_checked_on_entry(generator_module):
    specshim.configure(max_num_seqs=12)
    with specshim.configured(max_num_seqs=64, cache_memory_fraction=0.5) as state:
        assert generator_module.MAX_NUM_SEQS == 64
        assert generator_module.CACHE_MEMORY_FRACTION == 0.5
        assert state["max_num_seqs"]["source"] == "configured()"
        with specshim.configured(max_num_seqs=2):  # nests
            assert generator_module.MAX_NUM_SEQS == 2
        assert generator_module.MAX_NUM_SEQS == 64
    assert generator_module.MAX_NUM_SEQS == 12
    assert generator_module.CACHE_MEMORY_FRACTION == 0.2
    assert specshim.settings()["max_num_seqs"]["source"] == "configure()"
    with pytest.raises(SpecShimError, match="unknown setting"):
        specshim.configured(max_num_seq=1)
    with pytest.raises(SpecShimError, match="max_num_seqs must be >= 1"):
        with specshim.configured(max_num_seqs=0):
            pass
    assert generator_module.MAX_NUM_SEQS == 12
    # An exception inside the block restores too.
    with pytest.raises(KeyError):
        with specshim.configured(max_batched_tokens=99999):
            raise KeyError("boom")
    assert generator_module.MIN_MAX_BATCHED_TOKENS == 8192


def test_revert_undoes_everything_apply_and_configure_did():
    """In a fresh process: patches, constants, consent, hooks, finder all undone."""
    code = f"""
import sys, specshim
from specshim import _hooks, _registry
armed = bool(_hooks._callbacks) and _hooks._finder in sys.meta_path
import {GENERATOR} as g
from vllm.config import SchedulerConfig
upstream = {{n: getattr(g, n) for n in ("SchedulerConfig", "Request", "Scheduler",
            "MultiprocExecutor", "CacheConfig", "ModelConfig")}}
specshim.revert()
specshim.apply()  # re-arming after a revert is the same as the first time
assert g.SchedulerConfig is not SchedulerConfig
specshim.configure(max_num_seqs=99, trust_remote_code=True)
assert g.MAX_NUM_SEQS == 99
specshim.revert()
from specshim._settings import trust_remote_code
assert g.MAX_NUM_SEQS == 32 and g.MIN_MAX_BATCHED_TOKENS == 8192
assert not trust_remote_code()
assert all(r.state.value == "pending" for r in specshim.records())
assert g.SchedulerConfig is SchedulerConfig
assert not _hooks._callbacks, _hooks._callbacks
assert _hooks._finder not in sys.meta_path
assert not _registry.REGISTRY.active and not _registry.REGISTRY.hooked_modules
assert specshim.settings()["max_num_seqs"]["source"] == "speculators"
specshim.apply()  # and arming reads the environment again
assert g.SchedulerConfig is not SchedulerConfig and g.MAX_NUM_SEQS == 48
print("ok", armed)
"""
    done = _fresh_python(code, SPECSHIM_MAX_NUM_SEQS="48")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["ok", "True"]
