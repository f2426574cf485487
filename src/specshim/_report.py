"""What specshim found and did in this process."""

from __future__ import annotations

import os
import sys
from typing import Any

from specshim._base import GENERATOR, PACKAGES, UsageError
from specshim._registry import REGISTRY, records
from specshim._settings import settings, strict, trust_remote_code
from specshim._types import State
from specshim._versions import (
    installed_version,
    transformers_advice,
    version_advice,
    vllm_release_status,
)

PLUGIN_NAME = "specshim"


def plugin_status() -> dict[str, Any]:
    """Whether vLLM workers will load specshim's entry point."""
    import importlib.metadata

    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    installed = any(point.name == PLUGIN_NAME for point in points)
    allowed = _allowed_plugins()
    # vLLM's loader: `plugin.name in allowed_plugins`, None allowing all.
    return {
        "installed": installed,
        "allowed": allowed is None or PLUGIN_NAME in allowed,
        "VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS"),
    }


def _allowed_plugins() -> list[str] | None:
    """``VLLM_PLUGINS`` as vLLM's loader reads it; None (unset) allows every plugin.

    vLLM 0.11 to 0.32 split it on commas and nothing else: `` specshim`` is not
    ``specshim``, and an empty value allows none. Where ``vllm.envs`` is already
    loaded, its own parser answers (a release that changed it is then right
    too); importing it only for this would cost seconds (it imports torch).
    """
    envs = sys.modules.get("vllm.envs")
    parse = getattr(envs, "environment_variables", {}).get("VLLM_PLUGINS")
    if parse is not None:
        return parse()
    raw = os.environ.get("VLLM_PLUGINS")
    return None if raw is None else raw.split(",")


def report() -> dict[str, Any]:
    """Versions, plugin status, and each patch's state in this process."""
    patches = []
    every = records()
    for record in every:
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
                "requires": list(patch.requires),
                # Other patches wrapping the same target, in the order applied.
                "stacked_with": [
                    r.patch.id
                    for r in every
                    if r.patch.target == patch.target and r.patch.id != patch.id
                ],
                "turned_off_with": REGISTRY.turned_off_with(patch),
            }
        )
    release, release_why = vllm_release_status()
    knobs = settings()
    return {
        "versions": {name: installed_version(name) for name in PACKAGES},
        "vllm_release": {"status": release, "detail": release_why},
        "plugin": plugin_status(),
        "strict": strict(),
        "disabled": os.environ.get("SPECSHIM_DISABLE", ""),
        "patches": patches,
        "settings": knobs,
        "contract": capture_contract(),
        "advice": _advice(patches) + _settings_advice(knobs),
    }


def capture_contract() -> list[dict[str, str]]:
    """What every worker checks before capturing (patch ``capture-contract``)."""
    from specshim.patches.worker.capture_contract import CONTRACT

    return [{"term": t, "why": why, "how": how} for t, why, how in CONTRACT]


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
            f"VLLM_PLUGINS={plugin['VLLM_PLUGINS']!r} filters specshim out (vLLM "
            "splits it on commas and matches each name exactly, spaces included): "
            "add 'specshim' to it or unset it."
        )
    release, why = vllm_release_status()
    if release == "untested":
        advice.append(
            f"{why}. Run `specshim check` (and the compatibility suite, `make "
            "test-matrix VERSIONS=<this release>`) before launching jobs."
        )
    for name in ("vllm", "speculators"):
        if installed_version(name) is None:
            advice.append(f"{name} is not installed in this environment.")
    too_new = transformers_advice()
    if too_new:
        advice.append(too_new)
    for item in patches:
        if item["turned_off_with"] and item["state"] != State.DISABLED.value:
            off = ", ".join(item["turned_off_with"])
            advice.append(
                f"SPECSHIM_DISABLE turns off {off}, which patch {item['id']} needs: "
                f"{item['id']} is turned off with it wherever it would apply."
            )
        if item["state"] in (State.INCOMPATIBLE.value, State.FAILED.value):
            advice.append(
                f"Patch {item['id']} is {item['state']}: {item['detail']}. Check "
                "the vLLM version; SPECSHIM_DISABLE=" + item["id"] + " skips it."
            )
    return advice


def _settings_advice(knobs: dict[str, Any]) -> list[str]:
    """A bad ``SPECSHIM_*`` value: import kept going, the generator will refuse."""
    return [
        f"{item['error']} (the generator refuses to start until then)"
        for item in knobs.values()
        if item.get("error")
    ]


def format_report(data: dict[str, Any] | None = None) -> str:
    """A plain-text rendering of ``report()``."""
    data = data or report()
    lines = ["specshim report", ""]
    lines += [
        f"  {name:<13} {ver or 'not installed'}"
        for name, ver in data["versions"].items()
    ]
    release = data.get("vllm_release")
    if release:
        mark = "UNTESTED: " if release["status"] == "untested" else ""
        lines.append(f"  {'release':<13} {mark}{release['detail']}")
    plugin = data["plugin"]
    installed = "installed" if plugin["installed"] else "MISSING"
    allowed = "allowed" if plugin["allowed"] else "FILTERED OUT"
    lines.append(f"  plugin        entry point {installed}, {allowed} by VLLM_PLUGINS")
    lines.append("")
    if not data["patches"]:
        lines.append("  no patch is recorded in this process: specshim applied nothing")
    width = max((len(p["id"]) for p in data["patches"]), default=len("patch"))
    lines.append(f"  {'patch':<{width}}  {'runs in':<12}  {'state':<12}  detail")
    for item in data["patches"]:
        detail = item["detail"]
        if item["version_advice"] == "outside range" and item["state"] == "applied":
            detail += f" (note: meant for {item['meant_for']})"
        lines.append(
            f"  {item['id']:<{width}}  {item['process']:<12}  "
            f"{item['state']:<12}  {detail}"
        )
    knobs = data.get("settings", {})
    if knobs:
        lines += ["", f"  {'setting':<22}  {'value':<8}  source (variable)"]
        for name, item in knobs.items():
            value = "-" if item["value"] is None else item["value"]
            lines.append(
                f"  {name:<22}  {value!s:<8}  {item['source']} ({item['env']})"
            )
    if data.get("contract"):
        lines += [
            "",
            "  capture contract (checked in every worker at generator set-up):",
        ]
        lines += [f"    - {item['term']}: {item['why']}" for item in data["contract"]]
    if data["advice"]:
        lines += ["", "What to do:"] + [f"  - {line}" for line in data["advice"]]
    else:
        lines += ["", "Nothing to fix."]
    return "\n".join(lines)


def model_report(path: str) -> dict[str, Any]:
    """How the generator's (patched) ``ModelConfig`` treats one checkpoint.

    Builds the config exactly as speculators' generator does, through its
    module's view of ``ModelConfig``, so the answer includes ``text-only-loading``.
    """
    import importlib

    from specshim.patches.main.text_only_loading import supported_modalities

    generator = importlib.import_module(GENERATOR)
    config = generator.ModelConfig(
        model=path, tokenizer=path, trust_remote_code=trust_remote_code(), dtype="auto"
    )
    modalities = supported_modalities(config)
    multimodal = getattr(config, "multimodal_config", None)
    limits = (
        {name: multimodal.get_limit_per_prompt(name) for name in modalities}
        if multimodal is not None
        else {}
    )
    return {
        "path": path,
        "architecture": config.architecture,
        "model_type": getattr(config.hf_config, "model_type", None),
        "decoder_layers": config.get_total_num_hidden_layers(),
        "vocab_size": config.get_vocab_size(),
        "modalities": modalities,
        "limits": limits,
        "text_only": bool(modalities) and all(v == 0 for v in limits.values()),
    }


def format_model_report(data: dict[str, Any]) -> str:
    lines = [
        f"model {data['path']}",
        f"  {data['architecture']} ({data['model_type']}), "
        f"{data['decoder_layers']} decoder layers, vocabulary {data['vocab_size']}",
    ]
    if not data["modalities"]:
        lines.append("  text model: nothing to skip")
    elif data["text_only"]:
        limited = ", ".join(f"{name}=0" for name in data["modalities"])
        lines.append(
            f"  text-only-loading: encoder towers not built ({limited}); "
            "set SPECSHIM_DISABLE=text-only-loading to build them"
        )
    else:
        lines.append(
            f"  encoder towers WILL be built and profiled (limits {data['limits']}); "
            "hidden-state extraction never uses them"
        )
    return "\n".join(lines)


def environment_problems(data: dict[str, Any]) -> list[str]:
    """``SPECSHIM_*`` values that are not knobs but still wrong: a patch id
    ``SPECSHIM_DISABLE`` names that no patch has (a typo turns nothing off),
    and a ``SPECSHIM_SHM_MIB``, ``SPECSHIM_STITCH_REGIONS``,
    ``SPECSHIM_WRITER_THREADS``, ``SPECSHIM_SLAB_ROWS`` or ``SPECSHIM_SLABS``
    that is no number."""
    from specshim._base import (
        prepared_slabs,
        shm_limit,
        stitch_regions,
        writer_threads,
    )
    from specshim._settings import disabled_ids

    problems = []
    known = {patch["id"] for patch in data["patches"]}
    unknown = sorted(disabled_ids() - known - {"all"})
    if unknown:
        problems.append(
            f"SPECSHIM_DISABLE names no patch: {', '.join(unknown)}; it turns "
            "nothing off under those names (the ids are in the table above)"
        )
    for read in (shm_limit, stitch_regions, writer_threads, prepared_slabs):
        try:
            read()
        except UsageError as exc:
            problems.append(str(exc))
    return problems
