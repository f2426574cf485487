"""MLA off on vLLM's CPU platform where it cannot run, unless the user chose.

Why:
    DeepSeek-V2/V3 and Kimi-K2.5 use multi-head latent attention. vLLM's CPU
    backend had no MLA kernel before 0.28, so building the generator for such
    a model without a GPU fails in the attention backend selection; 0.28 added
    a CPU MLA backend but no CPU prefill for it (its MLA layers ask for the
    FlashAttention prefill), and from 0.29 it prefills with PyTorch. Its kernels
    take only DeepSeek-V3's latent width (kv_lora_rank + qk_rope_head_dim =
    576). ``VLLM_MLA_DISABLE=1`` makes vLLM run those models with plain
    attention (same weights, same outputs up to rounding). specshim sets it as
    the generator builds its config (before the ``ModelConfig`` and the
    workers, which inherit the environment) unless this vLLM has the CPU MLA
    backend with a CPU prefill and the model's latent width is 576; then the
    real MLA path runs (the reference tier checks it against HF). A value the
    user set is left alone.
Upstream change:
    Not drift: the CPU backend had no MLA. vLLM 0.28: a CPU MLA backend
    (``CPU_MLA``); 0.29: its CPU prefill.
Upstream PR:
    vllm-project/vllm#49453 (the CPU MLA backend).
Remove when:
    speculators 0.3.0's targets all run vLLM's CPU MLA (vLLM 0.29 is the oldest
    supported release and every MLA width has a CPU kernel).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from specshim._types import NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import wrap_call

logger = logging.getLogger(__name__)


def _probe(original: Any) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise NotNeeded(f"platform is {current_platform.device_type!r}, not cpu")


# The value specshim put in VLLM_MLA_DISABLE (decided again for each generator;
# a value the user set is never touched).
_ours: list[str] = []
CPU_MLA_WIDTH = 576  # kv_lora_rank + qk_rope_head_dim the CPU kernels take


def _before(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    current = os.environ.get("VLLM_MLA_DISABLE")
    if current is not None and not (_ours and current == _ours[0]):
        return  # the user chose
    path = kwargs.get("model_path", args[1] if len(args) > 1 else None)
    runs, why = cpu_mla_runs(path)
    value = "0" if runs else "1"
    os.environ["VLLM_MLA_DISABLE"] = value
    _ours[:] = [value]
    logger.info("specshim: set VLLM_MLA_DISABLE=%s (%s)", value, why)


def cpu_mla_missing() -> str | None:
    """None if this vLLM's CPU backend can prefill with MLA, else what it lacks."""
    import importlib.util

    backends = "vllm.v1.attention.backends.mla"
    for module, what in (
        (f"{backends}.cpu_mla", "no MLA backend for CPU (vLLM < 0.28)"),
        (f"{backends}.prefill.cpu_sdpa", "no CPU prefill for MLA (vLLM < 0.29)"),
    ):
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            return what
    return None


def cpu_mla_runs(model_path: Any) -> tuple[bool, str]:
    """Whether vLLM's CPU MLA can prefill this checkpoint, and why (or why not)."""
    import json
    from pathlib import Path

    missing = cpu_mla_missing()
    if missing:
        return False, missing
    try:
        config = json.loads((Path(str(model_path)) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False, "no readable config.json to take the MLA width from"
    text = config.get("text_config") or config
    width = (text.get("kv_lora_rank") or 0) + (text.get("qk_rope_head_dim") or 0)
    if width != CPU_MLA_WIDTH:
        return False, f"MLA width {width}; vLLM's CPU MLA takes {CPU_MLA_WIDTH}"
    return True, "vLLM's CPU MLA backend runs this model's latent attention"


PATCH = declare(
    __name__,
    __doc__,
    id="cpu-mla-disable",
    attribute="VllmHiddenStatesGenerator._create_vllm_config",
    versions=">=0.11",
    probe=_probe,
    build=lambda original: wrap_call(original, before=_before),
    platform="cpu",
    drift_rows=(21,),
)
