"""Text-only loading for multimodal targets (Kimi-K2.5, Qwen-VL, ...).

Why:
    The generator only ever feeds token ids, but vLLM builds, loads and
    profiles a multimodal model's encoder towers unless every modality the model
    supports is limited to zero items per prompt. For Kimi-K2.5 that is a
    MoonViT vision tower and projector on every GPU, plus the media processor's
    profiling dummies. speculators' ``ModelConfig`` sets no limits, so the
    towers are built for nothing. This patch asks the model's own processing
    info which modalities it supports (Kimi-K2.5's is ``vision_chunk``;
    ``image``/``video`` limits have no effect on it) and rebuilds the
    ``ModelConfig`` with each of them limited to 0. The text model's weights
    and outputs are unchanged; a ``limit_mm_per_prompt`` passed by the caller
    is kept as given. Disable this patch to load the towers anyway. From vLLM
    0.17 ``ModelConfig(language_model_only=True)`` says the same in one
    argument (every modality limited to 0); there the config is built once,
    with it, and no processor is created to ask.
Upstream change:
    Not drift: a saving since vLLM 0.15, which skips building encoder towers
    whose modalities are all limited to 0 (``SupportsMultiModal._mark_tower_model``)
    and added Kimi-K2.5. vLLM 0.17: ``ModelConfig(language_model_only=)``.
Upstream PR:
    vllm-project/vllm#32605 (encoder- and LM-only context managers);
    ``language_model_only``: not found.
Remove when:
    speculators builds its ``ModelConfig`` text-only itself.
"""

from __future__ import annotations

import logging
from typing import Any

from specshim._types import Incompatible, NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import parameters, wrap

logger = logging.getLogger(__name__)


def _probe(original: Any) -> None:
    if "limit_mm_per_prompt" not in parameters(original):
        raise Incompatible(
            "ModelConfig(..., limit_mm_per_prompt=...)",
            "no limit_mm_per_prompt parameter",
        )
    from vllm.model_executor.models.interfaces import SupportsMultiModal

    if not hasattr(SupportsMultiModal, "_mark_tower_model"):
        raise NotNeeded("this vLLM builds encoder towers whatever the limits")


def supported_modalities(model_config: Any) -> list[str]:
    """The modalities a multimodal model accepts (empty for a text model)."""
    if getattr(model_config, "multimodal_config", None) is None:
        return []
    from vllm.multimodal import MULTIMODAL_REGISTRY

    processor = MULTIMODAL_REGISTRY.create_processor(model_config)
    return sorted(processor.info.get_supported_mm_limits())


def _build(original: Any) -> Any:
    direct = "language_model_only" in parameters(original)

    def model_config(original: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        chosen = kwargs.get("limit_mm_per_prompt") is not None
        if direct and not chosen and "language_model_only" not in kwargs:
            config = original(*args, **kwargs, language_model_only=True)
            if getattr(config, "multimodal_config", None) is not None:
                logger.info(
                    "specshim: loading %s text-only (language_model_only): its "
                    "encoder towers are never used for hidden-state extraction",
                    config.architecture,
                )
            return config
        config = original(*args, **kwargs)
        if chosen or "language_model_only" in kwargs:
            return config
        modalities = supported_modalities(config)
        if not modalities:
            return config
        logger.info(
            "specshim: loading %s text-only (limit 0 for %s): its encoder "
            "towers are never used for hidden-state extraction",
            config.architecture,
            ", ".join(modalities),
        )
        return original(
            *args, **kwargs, limit_mm_per_prompt={name: 0 for name in modalities}
        )

    return wrap(original, model_config)


PATCH = declare(
    __name__,
    __doc__,
    id="text-only-loading",
    attribute="ModelConfig",
    versions=">=0.15",
    probe=_probe,
    build=_build,
    drift_rows=(22,),
)
