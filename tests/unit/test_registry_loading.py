"""How the registry is loaded and armed: import cost, the patch set handed in
apply order, the vLLM plugin entry point and forked workers."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from specshim import _registry
from specshim._base import SpecShimError

from ._registry_helpers import SOURCE, _patch


def test_import_specshim_pulls_in_neither_torch_nor_vllm():
    code = (
        "import specshim, sys; "
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _import_and_greet(name, queue):
    module = importlib.import_module(name)
    queue.put(module.greet("x"))


def test_patches_reach_forked_children(isolated_registry, fake_module):
    """vLLM may fork its workers (GPU); hooks armed before the fork still fire."""
    import multiprocessing

    name = fake_module(SOURCE)
    _patch(name)
    _registry.apply()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_import_and_greet, args=(name, queue))
    child.start()
    child.join(30)
    assert child.exitcode == 0 and queue.get(timeout=5) == "HELLO X"


def test_plugin_entry_point_arms_a_fresh_process():
    """What vLLM runs in each spawned worker before it loads the extension."""
    code = (
        "from importlib.metadata import entry_points\n"
        "(ep,) = [e for e in entry_points(group='vllm.general_plugins')"
        " if e.name == 'specshim']\n"
        "ep.load()()\n"
        "from specshim import _registry\n"
        "assert _registry.REGISTRY.active and _registry.REGISTRY.hooked_modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_registry_is_handed_the_patch_set_in_apply_order():
    """``specshim`` hands the registry the patch files' set; registering it is
    the registry's own act, in the order ``patches/__init__`` lists the files
    (importing a patch file registers nothing)."""
    from specshim import patches

    expected = [p.id for p in patches.PATCHES]
    assert [p.id for p in _registry.registry()] == expected
    assert len(expected) == len(patches.DEPS + patches.MAIN + patches.WORKER)
    fresh = _registry.Registry()
    assert fresh.patches() == []
    fresh.hand(lambda: patches.PATCHES)
    assert [p.id for p in fresh.patches()] == expected
    with pytest.raises(SpecShimError, match="loaded its patch set already"):
        fresh.hand(lambda: patches.PATCHES)  # it would register them twice
    assert [p.id for p in fresh.patches()] == expected
