"""Patches that cannot apply: incompatible targets, crashing probes and
builds, conflicting or duplicate declarations."""

from __future__ import annotations

import importlib

import pytest

from specshim import _registry
from specshim._base import SpecShimError, SpecShimWarning
from specshim._types import Incompatible, State

from ._registry_helpers import SOURCE, _patch, _state


def test_incompatible_raises_with_diagnosis(isolated_registry, fake_module):
    name = fake_module(SOURCE)

    def probe(original):
        raise Incompatible("greet(name, *, loud)", "greet(name)")

    _patch(name, probe=probe)
    _registry.apply()
    with pytest.raises(SpecShimError) as info:
        importlib.import_module(name)
    message = str(info.value)
    for needle in (
        "'shout'",
        f"{name}:greet",
        "greet(name, *, loud)",
        "found:",
        "vllm ",
        "SPECSHIM_DISABLE=shout",
    ):
        assert needle in message
    assert _state("shout") is State.INCOMPATIBLE


def test_optional_incompatible_warns_unless_strict(
    isolated_registry, fake_module, monkeypatch
):
    def probe(original):
        raise Incompatible("a", "b")

    module = importlib.import_module(fake_module(SOURCE))
    _patch(module.__name__, probe=probe, optional=True)
    with pytest.warns(SpecShimWarning, match="cannot apply"):
        _registry.apply()
    assert _state("shout") is State.INCOMPATIBLE

    _registry.revert()
    monkeypatch.setenv("SPECSHIM_STRICT", "1")
    with pytest.raises(SpecShimError):
        _registry.apply()


def test_missing_target_is_incompatible(isolated_registry, fake_module):
    module = importlib.import_module(fake_module(SOURCE))
    _patch(module.__name__, attribute="Nope.greet")
    with pytest.raises(SpecShimError, match="no such name"):
        _registry.apply()


def test_crashing_probe_is_failed_not_missing(isolated_registry, fake_module):
    module = importlib.import_module(fake_module(SOURCE))

    def probe(original):
        return original.no_such_attribute  # an AttributeError inside the probe

    _patch(module.__name__, probe=probe)
    with pytest.raises(SpecShimError, match="no_such_attribute") as info:
        _registry.apply()
    assert "no such name" not in str(info.value)
    assert _state("shout") is State.FAILED


def test_failed_build_is_reported(isolated_registry, fake_module):
    module = importlib.import_module(fake_module(SOURCE))

    def build(original):
        raise RuntimeError("boom")

    _patch(module.__name__, build=build)
    with pytest.raises(SpecShimError, match="boom"):
        _registry.apply()
    assert _state("shout") is State.FAILED


def test_replacement_conflicts_fail_loudly(isolated_registry, fake_module):
    name = fake_module(SOURCE)
    _patch(name, replaces=True)
    with pytest.raises(SpecShimError, match="'shout' and 'other'"):
        _patch(name, id="other")


def test_duplicate_ids_fail(isolated_registry, fake_module):
    name = fake_module(SOURCE)
    _patch(name)
    with pytest.raises(SpecShimError, match="share the id"):
        _patch(name, attribute="Thing.size")
