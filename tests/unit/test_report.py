"""``doctor``'s verdicts agree with what vLLM itself does."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from specshim._report import plugin_status

# Every shape of VLLM_PLUGINS a user might write (None: unset).
VLLM_PLUGINS_VALUES = [
    None,
    "",
    " ",
    ",",
    "specshim",
    " specshim",
    "specshim ",
    "\tspecshim",
    "other, specshim",
    "other,specshim",
    "specshim,",
    ",specshim",
    "specshim,specshim",
    "SPECSHIM",
    "specshim;other",
]


def _vllm_loads(monkeypatch: pytest.MonkeyPatch, value: str | None) -> bool:
    """Whether vLLM's own loader would load an entry point named ``specshim``."""
    from vllm import envs, plugins

    if value is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", value)
    if getattr(envs, "_is_envs_cache_enabled", lambda: False)():
        envs.disable_envs_cache()  # read the variable now, as a new worker does
    return "specshim" in plugins.load_plugins_by_group(plugins.DEFAULT_PLUGINS_GROUP)


@pytest.mark.parametrize("vllm_loaded", [True, False])
@pytest.mark.parametrize("value", VLLM_PLUGINS_VALUES)
def test_plugin_allowed_is_what_vllms_loader_does(monkeypatch, value, vllm_loaded):
    from vllm import plugins

    point = importlib.metadata.EntryPoint(
        "specshim", "specshim_vllm_plugin:register", plugins.DEFAULT_PLUGINS_GROUP
    )
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [point])
    expected = _vllm_loads(monkeypatch, value)
    if not vllm_loaded:  # doctor without vLLM imported reads the variable itself
        monkeypatch.delitem(sys.modules, "vllm.envs")
    status = plugin_status()
    assert status["installed"]
    assert status["allowed"] is expected, (value, expected)


def test_plugin_allowed_follows_the_loaded_vllms_own_parsing(monkeypatch):
    from vllm import envs

    monkeypatch.setenv("VLLM_PLUGINS", " specshim")
    assert not plugin_status()["allowed"]  # 0.11 to 0.32 do not strip names
    # A release that parsed the variable otherwise is taken at its word.
    monkeypatch.setitem(
        envs.environment_variables, "VLLM_PLUGINS", lambda: ["specshim"]
    )
    assert plugin_status()["allowed"]


def test_the_report_renders_without_any_patch_recorded():
    """A process where no patch was recorded gets a line saying so, not a
    traceback from the table's column width."""
    from specshim._report import format_report

    data = {
        "versions": {"vllm": None},
        "plugin": {"installed": True, "allowed": True},
        "patches": [],
        "advice": [],
    }
    text = format_report(data)
    assert "no patch is recorded in this process" in text
    assert text.endswith("Nothing to fix.")
