"""The settings the captured states depend on, checked in every worker.

Why:
    The captured rows are the model's residual stream, one row per scheduled
    token, only because of settings nothing in speculators checks.
    speculators' ``enforce_eager=True`` yields compilation mode NONE, no CUDA
    graphs and no sequence parallelism; DP is 1, so no padding and no
    dual-batch micro-batching; PP is 1, so one worker sees every layer. A user
    who sets another option, or a vLLM that compiles or pads despite
    ``enforce_eager``, would change that silently. And DeepSeek-family layers
    running in float16 rescale the residual stream by
    ``1 / routed_scaling_factor`` to avoid overflow (vLLM's
    ``deepseek_v2.py``, "Fix FP16 overflow"): the captured
    ``hidden_states + residual`` is then the true state times 0.4 for
    DeepSeek-V3, which no cosine check can see. Before the capture is set up,
    each worker checks every term of ``CONTRACT`` against its own config,
    runner and model, and refuses anything else with a sentence that names the
    setting and how to change it. (That every step's captured rows are exactly
    its scheduled tokens is proven per row by ``row-provenance``.)
Upstream change:
    None by itself: vLLM 0.12 and later default compilation, CUDA graphs and
    async scheduling on for GPU engines; ``enforce_eager`` turns them off.
    vLLM 0.32 deleted the sequence-parallelism pass with its flag.
Upstream PR:
    none: not an upstream change.
Remove when:
    speculators asserts its own capture preconditions.
"""

from __future__ import annotations

import functools
from typing import Any

from specshim.patches._declare import declare
from specshim.patches._wrappers import require_callable

# (term, why it matters, how to restore it); checked by ``violations``.
CONTRACT: tuple[tuple[str, str, str], ...] = (
    (
        "eager execution (compilation mode NONE)",
        "a compiled or fused graph may not run the decoder layers as modules",
        "keep enforce_eager=True (speculators' own setting)",
    ),
    (
        "no CUDA graphs",
        "graph replays pad a step to a captured size and skip the hooks",
        "keep enforce_eager=True; do not set compilation_config.cudagraph_mode",
    ),
    (
        "no sequence parallelism",
        "rows are split across ranks and padded to a multiple of the TP size",
        "leave compilation_config.pass_config.enable_sp off",
    ),
    (
        "no micro-batching (dual-batch overlap, ubatches)",
        "a step runs as several forwards whose rows interleave",
        "leave parallel_config.enable_dbo and ubatch_size at their defaults",
    ),
    (
        "data parallel size 1",
        "DP ranks pad their steps to a common size",
        "run one generator per DP rank instead (data_parallel_size=1)",
    ),
    (
        "pipeline parallel size 1",
        "rank 0 would not see the later layers",
        "use tensor parallelism (tensor_parallel_size) instead",
    ),
    (
        "a known model runner (vLLM's V1 or V2 GPU runner or a subclass)",
        "specshim's hooks are proven on these runners' forward",
        "use a vLLM runner; report the runner to specshim",
    ),
    (
        "no float16 residual rescaling (DeepSeek-family layers)",
        "float16 DeepSeek layers capture the state times 1/routed_scaling_factor",
        "run the model in bfloat16 (dtype='bfloat16') instead of float16",
    ),
)

_RUNNERS = (
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner",
)


def _name(value: Any) -> str:
    return str(getattr(value, "name", value))


def _compiled(compilation: Any) -> str | None:
    for field in ("mode", "level"):  # "level" before vLLM 0.12
        value = getattr(compilation, field, None)
        if value is not None:
            number = getattr(value, "value", value)
            return None if int(number) == 0 else f"compilation {field} {_name(value)}"
    return "no compilation mode or level to read"


def violations(vllm_config: Any, runner: Any, model: Any) -> list[str]:
    """Each broken term of ``CONTRACT``, as '<term>: <found>; <how to fix>'."""
    compilation = vllm_config.compilation_config
    parallel = vllm_config.parallel_config
    found = [
        _compiled(compilation),
        _cuda_graphs(vllm_config),
        _sequence_parallel(getattr(compilation, "pass_config", None)),
        _micro_batching(parallel),
        None
        if int(parallel.data_parallel_size) == 1
        else f"data_parallel_size {parallel.data_parallel_size}",
        None
        if int(parallel.pipeline_parallel_size) == 1
        else f"pipeline_parallel_size {parallel.pipeline_parallel_size}",
        _unknown_runner(runner),
        _rescaled(vllm_config, model),
    ]
    return [
        f"{term}: found {what}; {fix}"
        for (term, _, fix), what in zip(CONTRACT, found, strict=True)
        if what is not None
    ]


def _cuda_graphs(vllm_config: Any) -> str | None:
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    if mode is None:  # unresolved: off only because eager execution was asked for
        eager = getattr(vllm_config.model_config, "enforce_eager", False) is True
        return None if eager else "cudagraph_mode unset without enforce_eager"
    return None if _name(mode) == "NONE" else f"cudagraph_mode {_name(mode)}"


def _sequence_parallel(passes: Any) -> str | None:
    # "enable_sp" from vLLM 0.12, "enable_sequence_parallelism" before 0.13;
    # vLLM 0.32 deleted the pass and its flag.
    flags = [
        f for f in ("enable_sp", "enable_sequence_parallelism") if hasattr(passes, f)
    ]
    if not flags:
        passes_left = _sequence_parallel_passes()
        if passes_left:
            return (
                f"no sequence-parallelism flag to read (the pass is {passes_left[0]})"
            )
        return None  # no flag and no pass: vLLM has no sequence parallelism
    return "sequence parallelism on" if any(getattr(passes, f) for f in flags) else None


def _sequence_parallel_passes() -> list[str]:
    """vLLM's sequence-parallelism compile pass files, wherever they live."""
    from pathlib import Path

    import vllm.compilation

    root = Path(vllm.compilation.__file__).parent
    return sorted(
        str(p.relative_to(root.parent.parent))
        for p in root.rglob("*sequence_parallel*.py")
    )


def _micro_batching(parallel: Any) -> str | None:
    if not hasattr(parallel, "enable_dbo"):
        return "no enable_dbo to read"
    ubatches = int(getattr(parallel, "ubatch_size", 0) or 0)  # 0.16 and later
    return "micro-batching on" if parallel.enable_dbo or ubatches > 1 else None


def _unknown_runner(runner: Any) -> str | None:
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(runner).__mro__}
    if names & set(_RUNNERS):
        return None
    return f"runner {type(runner).__module__}.{type(runner).__qualname__}"


def _rescaled(vllm_config: Any, model: Any) -> str | None:
    import torch

    if vllm_config.model_config.dtype != torch.float16:
        return None
    for module in model.modules():
        factor = getattr(module, "routed_scaling_factor", None)
        if factor is not None and float(factor) != 1.0:
            return (
                f"float16 with {type(module).__name__}.routed_scaling_factor "
                f"{float(factor)}"
            )
    return None


def _build(original: Any) -> Any:
    @functools.wraps(original)
    def setup_hidden_states_capture(self: Any, layer_ids: list[int]) -> None:
        broken = violations(
            self.vllm_config, self.model_runner, self.model_runner.model
        )
        if broken:
            raise ValueError(
                "specshim refuses to capture hidden states it cannot vouch for: "
                + " | ".join(broken)
            )
        original(self, layer_ids)

    setup_hidden_states_capture.__specshim__ = True  # type: ignore[attr-defined]
    return setup_hidden_states_capture


PATCH = declare(
    __name__,
    __doc__,
    id="capture-contract",
    attribute="HiddenStatesWorkerExtension._setup_hidden_states_capture",
    versions=">=0.11",
    probe=require_callable(
        "HiddenStatesWorkerExtension._setup_hidden_states_capture(layer_ids)"
    ),
    build=_build,
    drift_rows=(25,),
)
