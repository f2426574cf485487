"""What specshim found and did in this process."""

from __future__ import annotations

import os
from typing import Any

from specshim._registry import (
    State,
    installed_version,
    records,
    strict,
    version_advice,
)

PLUGIN_NAME = "specshim"
PACKAGES = ("vllm", "speculators", "torch", "transformers")


def plugin_status() -> dict[str, Any]:
    """Whether vLLM workers will load specshim's entry point."""
    import importlib.metadata

    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    installed = any(point.name == PLUGIN_NAME for point in points)
    allowed_raw = os.environ.get("VLLM_PLUGINS")
    allowed = allowed_raw is None or PLUGIN_NAME in [
        name.strip() for name in allowed_raw.split(",")
    ]
    return {"installed": installed, "allowed": allowed, "VLLM_PLUGINS": allowed_raw}


def report() -> dict[str, Any]:
    """Versions, plugin status, and each patch's state in this process."""
    patches = []
    for record in records():
        patch = record.patch
        patches.append(
            {
                "id": patch.id,
                "process": patch.process,
                "target": patch.target,
                "state": record.state.value,
                "detail": record.detail,
                "meant_for": f"{patch.package} {patch.versions}",
                "version_advice": version_advice(patch),
                "drift_rows": list(patch.drift_rows),
                "optional": patch.optional,
            }
        )
    return {
        "versions": {name: installed_version(name) for name in PACKAGES},
        "plugin": plugin_status(),
        "strict": strict(),
        "disabled": os.environ.get("SPECSHIM_DISABLE", ""),
        "patches": patches,
        "advice": _advice(patches),
    }


def _advice(patches: list[dict[str, Any]]) -> list[str]:
    advice = []
    plugin = plugin_status()
    if not plugin["installed"]:
        advice.append(
            "The vllm.general_plugins entry point 'specshim' is not installed, so "
            "worker-side patches never reach vLLM's worker processes: reinstall "
            "specshim with pip (an editable or regular install registers it)."
        )
    elif not plugin["allowed"]:
        advice.append(
            f"VLLM_PLUGINS={plugin['VLLM_PLUGINS']!r} filters specshim out: add "
            "'specshim' to it or unset it."
        )
    for name in ("vllm", "speculators"):
        if installed_version(name) is None:
            advice.append(f"{name} is not installed in this environment.")
    for item in patches:
        if item["state"] in (State.INCOMPATIBLE.value, State.FAILED.value):
            advice.append(
                f"Patch {item['id']} is {item['state']}: {item['detail']}. Check "
                "the vLLM version; SPECSHIM_DISABLE=" + item["id"] + " skips it."
            )
    return advice


def format_report(data: dict[str, Any] | None = None) -> str:
    """A plain-text rendering of ``report()``."""
    data = data or report()
    lines = ["specshim report", ""]
    lines += [
        f"  {name:<13} {ver or 'not installed'}"
        for name, ver in data["versions"].items()
    ]
    plugin = data["plugin"]
    installed = "installed" if plugin["installed"] else "MISSING"
    allowed = "allowed" if plugin["allowed"] else "FILTERED OUT"
    lines.append(f"  plugin        entry point {installed}, {allowed} by VLLM_PLUGINS")
    lines.append("")
    width = max(len(p["id"]) for p in data["patches"])
    lines.append(f"  {'patch':<{width}}  {'runs in':<7}  {'state':<12}  detail")
    for item in data["patches"]:
        detail = item["detail"]
        if item["version_advice"] == "outside range" and item["state"] == "applied":
            detail += f" (note: meant for {item['meant_for']})"
        lines.append(
            f"  {item['id']:<{width}}  {item['process']:<7}  "
            f"{item['state']:<12}  {detail}"
        )
    if data["advice"]:
        lines += ["", "What to do:"] + [f"  - {line}" for line in data["advice"]]
    else:
        lines += ["", "Nothing to fix."]
    return "\n".join(lines)
