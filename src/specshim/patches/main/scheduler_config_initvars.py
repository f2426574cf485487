"""SchedulerConfig's new required InitVars.

Why:
    speculators builds ``SchedulerConfig(max_num_seqs=, max_model_len=,
    max_num_batched_tokens=)``. vLLM made ``max_model_len`` and
    ``is_encoder_decoder`` required InitVars, so construction fails with a
    pydantic ValidationError ("is_encoder_decoder: Field required").
    speculators only runs decoder-only targets, so ``is_encoder_decoder=False``.
Upstream change:
    vLLM 0.12 (``SchedulerConfig`` InitVars; ``SchedulerConfig.default_factory``
    fills them for internal callers).
Remove when:
    ``SchedulerConfig`` has no required ``is_encoder_decoder`` parameter, or
    speculators passes it (the probe then reports "not needed").
"""

from __future__ import annotations

from typing import Any

from specshim._registry import NotNeeded, Patch, register
from specshim.patches._util import GENERATOR, adapt_kwargs, parameters, required

_FILLED = ("is_encoder_decoder", "max_model_len")


def _probe(original: Any) -> None:
    params = parameters(original)
    if not any(name in params and required(params[name]) for name in _FILLED):
        raise NotNeeded("SchedulerConfig has no required InitVars to fill")


def _fill(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs.setdefault("is_encoder_decoder", False)
    kwargs.setdefault("max_model_len", 8192)  # upstream default_factory's value
    return kwargs


PATCH = register(
    Patch(
        id="scheduler-config-initvars",
        process="main",
        module=GENERATOR,
        attribute="SchedulerConfig",
        package="vllm",
        versions=">=0.12",
        probe=_probe,
        build=lambda original: adapt_kwargs(original, _fill),
        why=__doc__ or "",
        upstream="vLLM 0.12: SchedulerConfig InitVars",
        remove_when="SchedulerConfig has no required is_encoder_decoder",
        drift_rows=(1,),
    )
)
