"""The eagle3 gate: decide by structure, not by the SupportsEagle3 marker.

Why:
    speculators' worker extension refuses any model that does not implement
    vLLM's ``SupportsEagle3`` interface ("Model DeepseekV3ForCausalLM does not
    support hidden state extraction"). That marker is about vLLM's *own*
    EAGLE-3 serving path; hidden-state capture only needs a decoder stack with
    ``layers`` (and ``norm``), which DeepSeek-V2/V3 and the multimodal Kimi-K2.5
    wrapper have but never declare (they implement only ``SupportsEagle``).
    speculators' view of ``supports_eagle3`` accepts a model if vLLM's check
    passes or a decoder stack can be found (``capture-hooks`` finds it the same
    way).
Upstream change:
    DeepseekV2/V3 and KimiK25ForConditionalGeneration did not implement
    SupportsEagle3 in vLLM 0.11 - 0.17; from 0.18.0 they do, and vLLM's own
    check accepts them.
Upstream PR:
    not found (the DeepSeek/Kimi EAGLE-3 PRs found, vllm-project/vllm#32079
    and vllm-project/vllm#31257, were closed unmerged).
Remove when:
    vLLM 0.18 is the oldest release supported (the gate is not needed from
    there on), or speculators gates on structure.
"""

from __future__ import annotations

from typing import Any

from specshim._types import Incompatible, NotNeeded
from specshim.patches._declare import declare
from specshim.patches.worker._stack import find_decoder_stack


def _probe(original: Any) -> None:
    if original is None or not callable(original):
        raise Incompatible("custom_worker.supports_eagle3(model)", repr(original))
    from vllm.model_executor.models import deepseek_v2

    if original(deepseek_v2.DeepseekV2ForCausalLM):
        raise NotNeeded("vLLM's DeepSeek models declare SupportsEagle3")


def _build(original: Any) -> Any:
    def supports_eagle3(model: Any) -> bool:
        return bool(original(model)) or find_decoder_stack(model) is not None

    supports_eagle3.__wrapped__ = original  # type: ignore[attr-defined]
    supports_eagle3.__specshim__ = True  # type: ignore[attr-defined]
    return supports_eagle3


PATCH = declare(
    __name__,
    __doc__,
    id="eagle3-gate",
    attribute="supports_eagle3",
    versions=">=0.11,<0.18",
    probe=_probe,
    build=_build,
    drift_rows=(11, 16),
)
