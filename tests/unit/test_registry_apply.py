"""The registry on throwaway modules: lazy attach, apply/revert, stacking, and
what revert puts back on classes (inherited methods, descriptors)."""

from __future__ import annotations

import importlib
import sys

from specshim import _registry
from specshim._types import State

from ._registry_helpers import SOURCE, _patch, _state


def test_patch_attaches_when_the_module_is_imported(isolated_registry, fake_module):
    name = fake_module(SOURCE)
    _patch(name)
    _registry.apply()
    assert name not in sys.modules
    assert _state("shout") is State.PENDING
    module = importlib.import_module(name)
    assert module.greet("x") == "HELLO X"
    assert _state("shout") is State.APPLIED


def test_patch_attaches_at_once_if_already_imported(isolated_registry, fake_module):
    module = importlib.import_module(fake_module(SOURCE))
    _patch(module.__name__)
    _registry.apply()
    assert module.greet("x") == "HELLO X"


def test_apply_twice_is_a_no_op_and_revert_restores(isolated_registry, fake_module):
    module = importlib.import_module(fake_module(SOURCE))
    original = module.greet
    _patch(module.__name__)
    _registry.apply()
    _registry.apply()
    assert module.greet("x") == "HELLO X"  # wrapped once, not twice
    _registry.revert()
    assert module.greet is original
    assert _state("shout") is State.PENDING


def test_added_attribute_is_removed_on_revert(isolated_registry, fake_module):
    module = importlib.import_module(fake_module(SOURCE))
    _patch(
        module.__name__, attribute="Thing.extra", build=lambda original: lambda self: 2
    )
    _registry.apply()
    assert module.Thing().extra() == 2
    assert _registry.REGISTRY.record("shout").detail == "added"
    _registry.revert()
    assert not hasattr(module.Thing, "extra")


def test_wrappers_on_one_target_stack_and_unwind(isolated_registry, fake_module):
    module = importlib.import_module(fake_module(SOURCE))
    original = module.greet
    _patch(module.__name__)
    _patch(module.__name__, id="exclaim", build=lambda o: lambda name: o(name) + "!")
    _registry.apply()
    assert module.greet("x") == "HELLO X!"
    _registry.revert()
    assert module.greet is original


INHERITED = """
class Base:
    def size(self):
        return 1

    @classmethod
    def make(cls):
        return cls.__name__

class Child(Base):
    pass
"""


def test_a_patch_on_an_inherited_method_is_undone_by_inheritance(
    isolated_registry, fake_module
):
    """getattr finds Base.size through the MRO; putting that back on Child would
    shadow Base for good. Revert restores what Child itself held: nothing."""
    module = importlib.import_module(fake_module(INHERITED))
    _patch(
        module.__name__,
        attribute="Child.size",
        build=lambda original: lambda self: original(self) + 1,
    )
    _registry.apply()
    assert module.Child().size() == 2 and module.Base().size() == 1
    _registry.revert()
    assert "size" not in vars(module.Child)
    module.Base.size = lambda self: 5  # Child follows its base again
    assert module.Child().size() == 5


def test_a_classmethod_comes_back_as_the_descriptor_it_was(
    isolated_registry, fake_module
):
    module = importlib.import_module(fake_module(INHERITED))
    descriptor = vars(module.Base)["make"]
    _patch(
        module.__name__,
        attribute="Base.make",
        build=lambda original: classmethod(lambda cls: "patched " + original()),
    )
    _registry.apply()
    assert module.Base.make() == "patched Base"
    _registry.revert()
    assert vars(module.Base)["make"] is descriptor
    assert module.Child.make() == "Child"  # still bound to the class it is called on
