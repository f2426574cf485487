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
Upstream PR:
    vllm-project/vllm#28733 (``max_model_len`` init-only) and
    vllm-project/vllm#29859 (InitVars lose their defaults; a factory fills
    them).
Remove when:
    ``SchedulerConfig`` has no required ``is_encoder_decoder`` parameter, or
    speculators passes it (the probe then reports "not needed").
"""

from __future__ import annotations

from typing import Any

from specshim._types import NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import adapt_kwargs, parameters, required

_FILLED = ("is_encoder_decoder", "max_model_len")


def _probe(original: Any) -> None:
    params = parameters(original)
    if not any(name in params and required(params[name]) for name in _FILLED):
        raise NotNeeded("SchedulerConfig has no required InitVars to fill")


def _fill(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs.setdefault("is_encoder_decoder", False)
    kwargs.setdefault("max_model_len", 8192)  # upstream default_factory's value
    return kwargs


PATCH = declare(
    __name__,
    __doc__,
    id="scheduler-config-initvars",
    attribute="SchedulerConfig",
    versions=">=0.12",
    probe=_probe,
    build=lambda original: adapt_kwargs(original, _fill),
    drift_rows=(1,),
)
