"""Step budget and KV-cache knobs for speculators' generator.

speculators 0.3.0 hard-codes three module constants in
``speculators.data_generation.vllm_hidden_states_generator`` and reads them
each time a generator is built:

* ``MAX_NUM_SEQS`` (32): sequences the scheduler may put in one step;
* ``MIN_MAX_BATCHED_TOKENS`` (8192): the step's token budget is
  ``max(MIN_MAX_BATCHED_TOKENS, max_model_len)``;
* ``CACHE_MEMORY_FRACTION`` (0.2): the KV cache gets this fraction of
  ``free memory * gpu_memory_utilization``.

Fine for an 8B model on one GPU; a poor fit elsewhere. ``configure()`` (or the
``SPECSHIM_*`` environment variables, read when specshim is imported) sets them
on speculators' module, now if it is loaded, else as it loads. A generator
picks up the values current when it is *constructed*. Correctness does not
depend on them: specshim keeps chunked prefill off and guards every step, so
any budget yields the same rows.

A variable whose value fails its check does not fail ``import specshim`` (every
command, ``specshim --version`` included, imports it). It is remembered, shown
by ``settings()`` and ``doctor``, and raised where the value is used: by the
generator's constructor (``require_valid_environment``) and by ``resolve``. It
never silently becomes speculators' own value; ``configure()`` overrides it.
"""

from __future__ import annotations

import os
import sys
import threading

from specshim import _hooks
from specshim._base import (
    GENERATOR,
    SpecShimError,
    UsageError,
    prepared_slabs,
    shm_limit,
    stitch_regions,
)
from specshim._knobs import BY_NAME as _BY_NAME
from specshim._knobs import DEFAULT_BATCH_SIZE as DEFAULT_BATCH_SIZE  # re-exported
from specshim._knobs import GPU_STEP_DEFAULTS as GPU_STEP_DEFAULTS  # re-exported
from specshim._knobs import KNOBS, Knob, Refused
from specshim._knobs import STEP_DEFAULTS as STEP_DEFAULTS  # re-exported
from specshim._knobs import from_environment as _from_environment
from specshim._knobs import validate as _validate

TYPE_CHECKING = False  # typing costs ~15 ms to import; annotations are strings
if TYPE_CHECKING:
    from typing import Any


TRUST_ENV = "SPECSHIM_TRUST_REMOTE_CODE"

_lock = threading.Lock()
_trust: list[bool] = []  # [consent] once configure(trust_remote_code=) was called
_chosen: dict[str, Any] = {}  # knob name -> value set by configure() or env
_defaults: dict[str, Any] = {}  # knob name -> speculators' own value
_sources: dict[str, str] = {}  # knob name -> "configure()" or "env VAR"


def _push(module: Any) -> None:
    """Write the chosen values onto speculators' module (lock held)."""
    for knob in KNOBS:
        if knob.name not in _defaults and hasattr(module, knob.constant):
            _defaults[knob.name] = getattr(module, knob.constant)
        if knob.name in _chosen and not isinstance(_chosen[knob.name], Refused):
            setattr(module, knob.constant, _chosen[knob.name])
        elif knob.name in _defaults:  # a Refused one: the constructor refuses
            setattr(module, knob.constant, _defaults[knob.name])


def _on_import(module: Any) -> None:
    with _lock:
        _push(module)


def _write() -> None:
    """Write the settings now if speculators' module is loaded (else the hook will)."""
    module = sys.modules.get(GENERATOR)
    if module is not None:
        _on_import(module)


def arm() -> None:
    """Hook speculators' module and read the environment (``import specshim`` does).

    From then on the chosen values (or none yet) are in place before any
    generator reads them, whenever speculators is imported.
    """
    with _lock:
        first = not _armed
        _armed[:] = [True]
    if first:
        _hooks.when_imported(GENERATOR, _on_import)
    load_environment()


def disarm() -> None:
    """Undo ``arm`` and every ``configure``: speculators' own values, no hook.

    ``specshim.revert()`` calls this; ``specshim.apply()`` arms again.
    """
    _hooks.forget(GENERATOR, _on_import)
    with _lock:
        _armed.clear()
        _chosen.clear()
        _sources.clear()
        _trust.clear()
    _write()


_armed: list[bool] = []


def configure(
    *,
    max_num_seqs: int | None = None,
    max_batched_tokens: int | None = None,
    cache_memory_fraction: float | None = None,
    trust_remote_code: bool | None = None,
    reset: bool = False,
) -> dict[str, Any]:
    """Set speculators' step budget and KV-cache fraction; return what is in force.

    ``trust_remote_code=True`` consents to running the Python code a checkpoint
    ships (its ``auto_map``), which speculators would otherwise run unasked;
    without it (or ``SPECSHIM_TRUST_REMOTE_CODE=1``) such a checkpoint is
    refused. ``None`` leaves a setting as it is; ``reset=True`` first returns
    every setting to speculators' own value (and withdraws consent). Applies to
    generators constructed afterwards. Raises ``SpecShimError`` for a value out
    of range. ``configured(...)`` does the same for a ``with`` block only.
    """
    given = {
        "max_num_seqs": max_num_seqs,
        "max_batched_tokens": max_batched_tokens,
        "cache_memory_fraction": cache_memory_fraction,
    }
    if trust_remote_code is not None and not isinstance(trust_remote_code, bool):
        raise SpecShimError(
            f"specshim.configure: trust_remote_code must be True or False, got "
            f"{trust_remote_code!r}"
        )
    chosen = _checked(given, "specshim.configure", "configure()")
    with _lock:
        if reset:
            _trust.clear()
            _chosen.clear()
            _sources.clear()
        if trust_remote_code is not None:
            _trust[:] = [trust_remote_code]
    _set(chosen)
    return settings()


class preserved:  # noqa: N801 - used as a function: ``with preserved():``
    """Leaves the settings as the block found them (extract uses it)."""

    def __enter__(self) -> None:
        self._saved = snapshot()

    def __exit__(self, *exc_info: object) -> None:
        restore(self._saved)


class configured(preserved):  # noqa: N801 - used as ``with specshim.configured()``
    """``configure`` for the length of a ``with`` block; then exactly what was before.

    ``with specshim.configured(max_num_seqs=64) as state:`` - generators built
    inside use these values. Keywords as ``configure``; ``None`` leaves a
    setting as it is. The values are checked when the block is entered.
    """

    def __init__(self, **knobs: Any) -> None:
        unknown = set(knobs) - set(_BY_NAME)
        if unknown:
            raise SpecShimError(
                f"specshim.configured: unknown setting(s) {sorted(unknown)}; "
                f"known: {sorted(_BY_NAME)}"
            )
        self._knobs = knobs

    def __enter__(self) -> dict[str, Any]:  # type: ignore[override]
        chosen = _checked(self._knobs, "specshim.configured", "configured()")
        super().__enter__()
        _set(chosen)
        return settings()


def resolve(
    flags: dict[str, Any], defaults: dict[str, Any], caller: str
) -> dict[str, tuple[Any, str]]:
    """The one precedence rule: a flag, else the environment, else the default.

    ``flags`` maps knob names to a value or None (not given). Returns each
    knob's checked value and where it came from, for ``apply_resolved``.
    """
    out: dict[str, tuple[Any, str]] = {}
    for knob in KNOBS:
        flag = flags.get(knob.name)
        if flag is not None:
            value = _validate(knob, flag, "", knob.flag)
            out[knob.name] = (value, f"flag {knob.flag}")
        elif (from_env := _from_environment(knob)) is not None:
            out[knob.name] = (from_env, f"env {knob.env}")
        else:
            value = _validate(knob, defaults[knob.name], caller)
            out[knob.name] = (value, f"{caller} default")
    return out


def apply_resolved(chosen: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    """Put ``resolve``'s values in force; returns ``settings()``."""
    _set(chosen)
    return settings()


def _checked(
    given: dict[str, Any], caller: str, source: str
) -> dict[str, tuple[Any, str]]:
    return {
        name: (_validate(_BY_NAME[name], value, caller), source)
        for name, value in given.items()
        if value is not None
    }


def _set(chosen: dict[str, tuple[Any, str]]) -> None:
    with _lock:
        for name, (value, source) in chosen.items():
            _chosen[name], _sources[name] = value, source
    _write()


def trust_remote_code() -> bool:
    """Whether the user consented to checkpoint code (configure() > environment)."""
    with _lock:
        if _trust:
            return _trust[0]
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes")


def snapshot() -> tuple[dict[str, Any], dict[str, str], list[bool]]:
    """The settings chosen so far, for ``restore``."""
    with _lock:
        return dict(_chosen), dict(_sources), list(_trust)


def restore(saved: tuple[dict[str, Any], dict[str, str], list[bool]]) -> None:
    """Put back what ``snapshot`` saw."""
    with _lock:
        _chosen.clear()
        _chosen.update(saved[0])
        _sources.clear()
        _sources.update(saved[1])
        _trust[:] = saved[2]
    _write()


def settings() -> dict[str, Any]:
    """Each knob: its value in force and where it came from."""
    out: dict[str, Any] = {}
    module = sys.modules.get(GENERATOR)
    with _lock:
        for knob in KNOBS:
            chosen = _chosen.get(knob.name)
            if isinstance(chosen, Refused):
                out[knob.name] = _refused_entry(knob, chosen)
                continue
            if knob.name in _chosen:
                value, source = chosen, _sources[knob.name]
            elif module is not None and hasattr(module, knob.constant):
                value, source = getattr(module, knob.constant), "speculators"
            else:
                value, source = None, "speculators (not imported yet)"
            out[knob.name] = {
                "value": value,
                "source": source,
                "constant": knob.constant,
                "env": knob.env,
            }
    return out


def _refused_entry(knob: Knob, refused: Refused) -> dict[str, Any]:
    # No value is in force: the generator's constructor refuses to run.
    return {
        "value": None,
        "source": f"bad env {knob.env}",
        "constant": knob.constant,
        "env": knob.env,
        "error": refused.message,
    }


def require_valid_environment() -> None:
    """Raise ``UsageError`` for each bad ``SPECSHIM_*`` value still in force.

    The generator's constructor calls it (patch ``remote-code-gate``), where
    speculators reads the constants: a bad value stops it there, naming the
    variable, instead of speculators' own value being used unasked.
    """
    with _lock:
        refused = [_chosen.get(knob.name) for knob in KNOBS]
    errors = [value.message for value in refused if isinstance(value, Refused)]
    for read in (shm_limit, stitch_regions, prepared_slabs):  # refused here first
        try:
            read()
        except UsageError as exc:
            errors.append(str(exc))
    if errors:
        raise UsageError("; ".join(errors))


def load_environment() -> None:
    """Read the ``SPECSHIM_*`` knob variables (``arm`` does, at import).

    A bad value is kept as ``Refused``, not raised: importing must not fail.
    """
    found: dict[str, Any] = {}
    for knob in KNOBS:
        try:
            value = _from_environment(knob)
        except UsageError as exc:
            value = Refused(str(exc))
        if value is not None:
            found[knob.name] = value
    if not found:
        return
    with _lock:
        for name, value in found.items():
            if name not in _chosen:  # configure() wins over the environment
                _chosen[name] = value
                _sources[name] = f"env {_BY_NAME[name].env}"
    _write()


def disabled_ids() -> set[str]:
    """Patch ids ``SPECSHIM_DISABLE`` (comma-separated) switches off; "all" is all."""
    raw = os.environ.get("SPECSHIM_DISABLE", "")
    return {item.strip() for item in raw.split(",") if item.strip()}


def strict() -> bool:
    """``SPECSHIM_STRICT=1``: an optional patch that cannot apply, or an untested
    vLLM release, is an error rather than a warning."""
    return os.environ.get("SPECSHIM_STRICT", "").lower() in ("1", "true", "yes")
