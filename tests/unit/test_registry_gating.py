"""What keeps a patch off: its probe saying not needed, SPECSHIM_DISABLE, and
the patches it requires."""

from __future__ import annotations

import importlib

import pytest

from specshim import _registry
from specshim._base import HOOKED_MODULES, SpecShimError, SpecShimWarning
from specshim._types import NotNeeded, State

from ._registry_helpers import SOURCE, _declared, _patch, _state


def test_not_needed_leaves_target_alone(isolated_registry, fake_module):
    module = importlib.import_module(fake_module(SOURCE))
    original = module.greet

    def probe(original):
        raise NotNeeded("already fine")

    _patch(module.__name__, probe=probe)
    _registry.apply()
    assert module.greet is original
    assert _state("shout") is State.NOT_NEEDED


@pytest.mark.parametrize("disabled", ["shout, other", "all"])
def test_disabled_by_environment(isolated_registry, fake_module, monkeypatch, disabled):
    monkeypatch.setenv("SPECSHIM_DISABLE", disabled)
    module = importlib.import_module(fake_module(SOURCE))
    original, original_size = module.greet, module.Thing.size
    _patch(module.__name__)
    _patch(module.__name__, id="other", attribute="Thing.size")
    _registry.apply()
    assert module.greet is original and module.Thing.size is original_size
    assert _state("shout") is State.DISABLED and _state("other") is State.DISABLED


def test_unknown_disabled_id_warns(isolated_registry, fake_module, monkeypatch):
    monkeypatch.setenv("SPECSHIM_DISABLE", "no-such-patch")
    _patch(fake_module(SOURCE))
    with pytest.warns(SpecShimWarning, match="no-such-patch"):
        _registry.apply()


def test_requires_names_a_registered_patch(isolated_registry):
    hooked = HOOKED_MODULES[0]
    _registry.REGISTRY.hand(lambda: [_declared(hooked, requires=("no-such",))])
    with pytest.raises(SpecShimError, match=r"'shout' requires unknown .*no-such"):
        _registry.REGISTRY.load()


def test_a_patch_is_turned_off_with_a_patch_it_requires(
    isolated_registry, fake_module, monkeypatch
):
    monkeypatch.setenv("SPECSHIM_DISABLE", "base")
    module = importlib.import_module(fake_module(SOURCE))
    original = module.greet
    _patch(module.__name__, id="base", attribute="Thing.size")
    _patch(module.__name__, id="middle", attribute="Thing.size", requires=("base",))
    _patch(module.__name__, requires=("middle",))  # through "middle"
    _registry.apply()
    assert module.greet is original
    record = _registry.REGISTRY.record("shout")
    assert record.state is State.DISABLED
    assert record.detail == "needs base, which SPECSHIM_DISABLE turns off"


def test_doctor_names_a_partial_disable(monkeypatch):
    """The real declarations: request-args relies on generate-guard's hasher."""
    from specshim._report import report

    monkeypatch.setenv("SPECSHIM_DISABLE", "generate-guard")
    data = report()
    entry = next(p for p in data["patches"] if p["id"] == "request-args")
    assert entry["requires"] == ["generate-guard"]
    assert entry["turned_off_with"] == ["generate-guard"]
    assert any(
        "turns off generate-guard, which patch request-args needs" in line
        for line in data["advice"]
    )
