"""End-to-end fixtures: the unmodified speculators generator on vLLM's CPU backend."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

LAYERS = [1, 3, 5]
MAX_MODEL_LEN = 1024
# The Hugging Face model each fixture is checked against. Kimi-K2.5's text
# weights are exactly the tiny DeepSeek-V3's (same seed), and its text model is
# a DeepseekV3ForCausalLM.
HF_REFERENCE = {"kimi_k25": "deepseek_v3"}


def make_generator(path: str, tp: int, layer_ids: list[int] | None = None) -> Any:
    from speculators.data_generation import VllmHiddenStatesGenerator

    import specshim  # noqa: F401  (arms the patches before speculators loads)

    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    else:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return VllmHiddenStatesGenerator(
        str(path),
        layer_ids=LAYERS if layer_ids is None else layer_ids,
        max_model_len=MAX_MODEL_LEN,
        tensor_parallel_size=tp,
    )


def close_generator(generator: Any) -> None:
    generator.executor.shutdown()


@pytest.fixture(scope="session")
def hf_reference() -> Any:
    from specshim.testing.reference import HFReference

    cache: dict[str, HFReference] = {}

    def get(path: Any) -> HFReference:
        key = str(path)
        if key not in cache:
            cache[key] = HFReference(key)
        return cache[key]

    return get


@pytest.fixture(
    scope="module",
    params=[
        ("llama", 1),
        ("qwen2", 1),
        ("deepseek_v3", 1),
        ("kimi_k25", 1),
        pytest.param(("llama", 2), marks=pytest.mark.tp2),
        pytest.param(("qwen2", 2), marks=pytest.mark.tp2),
        pytest.param(("deepseek_v3", 2), marks=pytest.mark.tp2),
        pytest.param(("kimi_k25", 2), marks=pytest.mark.tp2),
    ],
    ids=lambda p: f"{p[0]}-tp{p[1]}",
)
def generator(request: pytest.FixtureRequest, tiny_model_dir: Any) -> Iterator[Any]:
    name, tp = request.param
    gen = make_generator(str(tiny_model_dir(name)), tp)
    gen.specshim_reference_name = HF_REFERENCE.get(name, name)
    try:
        yield gen
    finally:
        close_generator(gen)
