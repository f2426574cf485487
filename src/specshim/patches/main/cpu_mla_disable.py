"""MLA off on vLLM's CPU platform, unless the user chose.

Why:
    DeepSeek-V2/V3 and Kimi-K2.5 use multi-head latent attention; vLLM has no
    MLA kernel for its CPU backend, so building the generator for such a model
    on a machine without a GPU fails in the attention backend selection.
    ``VLLM_MLA_DISABLE=1`` makes vLLM run those models with plain attention
    (same weights, same outputs up to rounding). It must be set before the
    ``ModelConfig`` is built and before workers are spawned (they inherit the
    environment), so it is set as the generator builds its config.
Upstream change:
    Not drift: the CPU backend never had MLA. Needed for every CPU run.
Upstream PR:
    none: not an upstream change.
Remove when:
    vLLM's CPU platform supports MLA.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from specshim._types import NotNeeded
from specshim.patches._util import declare, wrap_call

logger = logging.getLogger(__name__)


def _probe(original: Any) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise NotNeeded(f"platform is {current_platform.device_type!r}, not cpu")


def _before(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if "VLLM_MLA_DISABLE" not in os.environ:
        os.environ["VLLM_MLA_DISABLE"] = "1"
        logger.info("specshim: set VLLM_MLA_DISABLE=1 (no MLA kernel on CPU)")


PATCH = declare(
    __name__,
    __doc__,
    id="cpu-mla-disable",
    attribute="VllmHiddenStatesGenerator._create_vllm_config",
    versions=">=0.11",
    probe=_probe,
    build=lambda original: wrap_call(original, before=_before),
    platform="cpu",
)
