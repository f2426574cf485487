"""Shared by the ``test_registry_*`` modules: a throwaway module's source and
throwaway patches on it."""

from __future__ import annotations

from specshim import _registry
from specshim._types import Patch, State

SOURCE = """
def greet(name):
    return "hello " + name

class Thing:
    def size(self):
        return 1
"""


def _declared(module: str, **overrides) -> Patch:
    """A throwaway patch, not yet registered."""
    fields = dict(
        id="shout",
        process="main",
        module=module,
        attribute="greet",
        package="vllm",
        versions=">=0.12",
        probe=lambda original: None,
        build=lambda original: lambda name: original(name).upper(),
        why="w",
        upstream="u",
        remove_when="r",
    )
    fields.update(overrides)
    return Patch(**fields)


def _patch(module: str, **overrides) -> Patch:
    return _registry.register(_declared(module, **overrides))


def _state(patch_id: str) -> State:
    return _registry.REGISTRY.record(patch_id).state
