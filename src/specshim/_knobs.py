"""The knobs: what each setting is, how a value is checked, and reading one
from its ``SPECSHIM_*`` variable.

Nothing here holds state: ``specshim._settings`` keeps what is chosen, puts it
on speculators' module, and re-exports these names.
"""

from __future__ import annotations

import os

from specshim._base import UsageError

TYPE_CHECKING = False  # typing costs ~15 ms to import; annotations are strings
if TYPE_CHECKING:
    from typing import Any


class Knob:
    """One setting (a plain class: a dataclass costs import time)."""

    __slots__ = (
        "constant",
        "env",
        "high",
        "kind",
        "low",
        "meaning",
        "name",
        "speculators",
    )

    def __init__(
        self,
        name: str,  # configure() keyword; extract's flag is --name-with-dashes
        constant: str,  # speculators' module constant
        env: str,  # environment variable
        kind: type,
        low: float,  # smallest allowed value
        high: float | None,  # largest allowed value (None: unbounded)
        meaning: str,
        speculators: float,  # speculators 0.3.0's own value
    ) -> None:
        self.name, self.constant, self.env = name, constant, env
        self.kind, self.low, self.high, self.meaning = kind, low, high, meaning
        self.speculators = speculators

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


KNOBS: tuple[Knob, ...] = (
    Knob(
        "max_num_seqs",
        "MAX_NUM_SEQS",
        "SPECSHIM_MAX_NUM_SEQS",
        int,
        1,
        None,
        "sequences per scheduler step",
        32,
    ),
    Knob(
        "max_batched_tokens",
        "MIN_MAX_BATCHED_TOKENS",
        "SPECSHIM_MAX_BATCHED_TOKENS",
        int,
        1,
        None,
        "tokens per scheduler step (at least max_model_len)",
        8192,
    ),
    Knob(
        "cache_memory_fraction",
        "CACHE_MEMORY_FRACTION",
        "SPECSHIM_CACHE_MEMORY_FRACTION",
        float,
        0.0,
        1.0,
        "fraction of free memory x gpu_memory_utilization given to the KV cache",
        0.2,
    ),
)
BY_NAME = {knob.name: knob for knob in KNOBS}

# extract's step budget and batch size, chosen by `make bench` (the fastest
# correct point on the DeepSeek model, the most frugal one within 3%; see
# benchmarks/results/bench.md and docs/performance.md). On a CPU that is
# speculators' own budget: larger steps were not faster there. A unit test keeps
# these equal to the committed benchmark's choice.
STEP_DEFAULTS = {
    "max_num_seqs": 32,
    "max_batched_tokens": 8192,
    "cache_memory_fraction": 0.2,
}
DEFAULT_BATCH_SIZE = 32

# extract's step budget on a GPU, where larger steps are faster: chosen by
# `make bench-gpu` (benchmarks/results/gpu.md: on the H200, 32,768 tokens a
# step ran extract 9% faster on the 1.2B Llama, 14% on the Kimi-like MLA MoE
# and within 1% on the Kimi-width one). A unit test keeps it within 3% of the
# fastest budget measured on every model.
GPU_STEP_DEFAULTS = {"max_batched_tokens": 32768}


class Refused:
    """A ``SPECSHIM_*`` value that failed its check, kept in its place.

    Kept among ``specshim._settings``' chosen values: ``configure()`` overrides
    it, ``reset`` drops it and ``snapshot``/``restore`` carry it like any chosen
    value.
    """

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def validate(knob: Knob, value: Any, source: str, label: str = "") -> Any:
    """``value`` as the knob's number; a ``UsageError`` naming ``label`` (the
    flag given, else the setting's name) and ``source`` if it is not one."""
    what = f"{source}: " * bool(source) + (label or knob.name)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UsageError(f"{what} must be a number, got {value!r}")
    try:
        number = knob.kind(value)
    except ValueError:
        kind = "an integer" if knob.kind is int else "a number"
        raise UsageError(f"{what} must be {kind}, got {value!r}") from None
    if knob.kind is int and isinstance(value, float) and value != number:
        raise UsageError(f"{what} must be an integer, got {value!r}")
    if number != number:  # NaN
        raise UsageError(f"{what} must be a number, got {value!r}")
    too_low = number <= knob.low if knob.kind is float else number < knob.low
    too_high = knob.high is not None and number > knob.high
    if too_low or too_high:
        bound = f"in (0, {knob.high}]" if knob.kind is float else f">= {int(knob.low)}"
        raise UsageError(f"{what} must be {bound} ({knob.meaning}), got {value!r}")
    return number


def from_environment(knob: Knob) -> Any:
    """The knob's checked value from its ``SPECSHIM_*`` variable; None if unset."""
    raw = os.environ.get(knob.env, "").strip()
    if not raw:
        return None
    try:
        return validate(knob, raw, f"environment {knob.env}")
    except UsageError as exc:
        raise UsageError(f"{exc}; fix or unset {knob.env}") from None
