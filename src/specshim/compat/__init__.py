"""The compatibility check users run before launching a job: ``specshim check``.

It runs against whatever vLLM and speculators are installed, without a GPU and
without loading a model:

* both speculators modules import with the patches armed;
* every patch target resolves, and each applied patch's probe still accepts
  what it replaced (a drifted target shows up as ``incompatible``/``failed``);
* each patch applied exactly where its upstream change exists: ``applied`` if
  the installed vLLM is in the patch's declared range (the release that
  introduced the change, e.g. ``>=0.12``) and its platform matches, else
  ``not needed`` - so a probe and its declared history cannot silently
  disagree;
* the installed speculators files are byte-for-byte as shipped.

Also runnable as a pytest module: ``pytest --pyargs specshim.compat``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from specshim._base import HOOKED_MODULES


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def _import_targets() -> list[Check]:
    from specshim._base import SpecShimError

    checks = []
    for name in HOOKED_MODULES:
        try:
            importlib.import_module(name)
        except (SpecShimError, ImportError) as exc:
            from specshim._versions import transformers_advice

            hint = transformers_advice()
            detail = f"{exc}" + (f" ({hint})" if hint else "")
            checks.append(Check(f"import {name}", False, detail))
        else:
            checks.append(Check(f"import {name}", True, "imported, patches armed"))
    return checks


def expected_state(patch, platform: str) -> str:  # noqa: ANN001
    """What the declared history says this patch's state should be here."""
    from specshim._versions import version_advice

    if version_advice(patch) != "in range":
        return "not needed"
    if patch.platform and patch.platform != platform:
        return "not needed"
    return "applied"


def _current_platform() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else str(current_platform.device_type)


def _patches() -> list[Check]:
    from specshim._registry import records
    from specshim._settings import strict
    from specshim._types import Incompatible, NotNeeded, State
    from specshim._versions import vllm_release_status

    platform = _current_platform()
    untested = vllm_release_status()[0] == "untested"
    checks = []
    for record in records():
        patch = record.patch
        name = f"patch {patch.id}"
        state = record.state
        if state is State.DISABLED:
            checks.append(Check(name, True, f"disabled by the user ({record.detail})"))
            continue
        if state in (State.INCOMPATIBLE, State.FAILED, State.PENDING):
            checks.append(
                Check(name, False, f"{state.value}: {patch.target}: {record.detail}")
            )
            continue
        if state is State.APPLIED and record.had_attribute:
            try:
                patch.probe(record.original)
            except (NotNeeded, Incompatible) as exc:
                checks.append(
                    Check(name, False, f"probe no longer accepts {patch.target}: {exc}")
                )
                continue
        expected = expected_state(patch, platform)
        if state.value != expected and untested and not strict():
            checks.append(
                Check(
                    name,
                    True,
                    f"{state.value} by its probe ({record.detail}); its history "
                    f"({patch.package} {patch.versions}) says {expected}, but "
                    "this release is untested, so the probe decides",
                )
            )
            continue
        if state.value != expected:
            checks.append(
                Check(
                    name,
                    False,
                    f"{state.value}, but {patch.package} {patch.versions} on "
                    f"{platform} says {expected}: {record.detail}. The upstream "
                    "change is not where the patch's history puts it.",
                )
            )
            continue
        checks.append(Check(name, True, f"{state.value} ({record.detail})"))
    return checks


def _speculators_unmodified() -> Check:
    import base64
    import hashlib
    import importlib.metadata

    dist = importlib.metadata.distribution("speculators")
    changed = []
    for entry in dist.files or []:
        if entry.hash is None or not str(entry).endswith(".py"):
            continue
        digest = hashlib.new(entry.hash.mode, entry.locate().read_bytes()).digest()
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != entry.hash.value:
            changed.append(str(entry))
    if changed:
        return Check(
            "speculators files as shipped",
            False,
            f"modified on disk: {', '.join(changed[:5])}",
        )
    return Check("speculators files as shipped", True, f"speculators {dist.version}")


def _release() -> Check:
    """Whether the installed vLLM is one the matrix proves."""
    from specshim._registry import records
    from specshim._settings import strict
    from specshim._types import State
    from specshim._versions import vllm_release_status

    status, why = vllm_release_status()
    if status == "tested":
        return Check("vLLM release", True, why)
    if status == "untested":
        applied = [r.patch.id for r in records() if r.state is State.APPLIED]
        detail = (
            f"UNTESTED. {why}; applied: {', '.join(applied) or 'none'}. Run the "
            "compatibility suite on it before trusting its output"
        )
        if strict():
            return Check("vLLM release", False, detail + " (SPECSHIM_STRICT=1)")
        return Check("vLLM release", True, detail + " (SPECSHIM_STRICT=1 fails here)")
    return Check("vLLM release", False, why)


def run_checks() -> list[Check]:
    """Every check, in order; a failed import stops the patch checks."""
    checks = _import_targets()
    if all(check.ok for check in checks):
        checks += _patches()
        checks.append(_release())
    checks.append(_speculators_unmodified())
    return checks


def format_checks(checks: list[Check]) -> str:
    from specshim._versions import installed_versions_line

    width = max(len(check.name) for check in checks)
    lines = [f"specshim check ({installed_versions_line()})", ""]
    for check in checks:
        mark = "ok  " if check.ok else "FAIL"
        lines.append(f"  {mark}  {check.name:<{width}}  {check.detail}")
    bad = [check for check in checks if not check.ok]
    lines.append("")
    if bad:
        lines.append(
            f"{len(bad)} check(s) failed: this vLLM/speculators pair has drifted "
            "from what specshim knows. Do not launch extraction jobs on it; "
            "run `specshim doctor` for advice."
        )
    else:
        lines.append("All checks passed.")
    return "\n".join(lines)
