"""The capture contract refuses each setting the captured states depend on."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from specshim.patches.worker import capture_contract


class Mode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2


class GPUModelRunner:  # stands in for vLLM's V1 runner (same module and name)
    pass


GPUModelRunner.__module__ = "vllm.v1.worker.gpu_model_runner"


class V2Runner:
    pass


V2Runner.__module__ = "vllm.v1.worker.gpu.model_runner"
V2Runner.__qualname__ = "GPUModelRunner"


class CPUModelRunner(GPUModelRunner):
    pass


class DeepseekLayer(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.routed_scaling_factor = factor


def _config(**changes):
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(
            mode=Mode.NONE,
            cudagraph_mode=Mode.NONE,
            pass_config=SimpleNamespace(enable_sp=False),
        ),
        parallel_config=SimpleNamespace(
            data_parallel_size=1,
            pipeline_parallel_size=1,
            enable_dbo=False,
            ubatch_size=0,
        ),
        model_config=SimpleNamespace(dtype=torch.bfloat16, enforce_eager=True),
    )
    for path, value in changes.items():
        target = config
        *parents, leaf = path.split("__")
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, leaf, value)
    return config


def test_speculators_own_settings_pass_on_both_runner_shapes():
    model = nn.Sequential(DeepseekLayer(2.5))
    for runner in (CPUModelRunner(), V2Runner()):
        assert capture_contract.violations(_config(), runner, model) == []
    # pre-0.12 configs have a compilation level instead of a mode
    old = _config()
    del old.compilation_config.mode
    old.compilation_config.level = 0
    del old.compilation_config.pass_config.enable_sp
    old.compilation_config.pass_config.enable_sequence_parallelism = False
    assert capture_contract.violations(old, CPUModelRunner(), model) == []


@pytest.mark.parametrize(
    ("changes", "term"),
    [
        ({"compilation_config__mode": Mode.PIECEWISE}, "eager execution"),
        ({"compilation_config__cudagraph_mode": Mode.FULL}, "no CUDA graphs"),
        (
            {"compilation_config__pass_config__enable_sp": True},
            "no sequence parallelism",
        ),
        ({"parallel_config__enable_dbo": True}, "no micro-batching"),
        ({"parallel_config__ubatch_size": 2}, "no micro-batching"),
        ({"parallel_config__data_parallel_size": 2}, "data parallel size 1"),
        ({"parallel_config__pipeline_parallel_size": 2}, "pipeline parallel"),
        ({"model_config__dtype": torch.float16}, "no float16 residual rescaling"),
    ],
)
def test_each_violation_is_named_with_its_fix(changes, term):
    model = nn.Sequential(DeepseekLayer(2.5))
    found = capture_contract.violations(_config(**changes), CPUModelRunner(), model)
    assert len(found) == 1 and found[0].startswith(term), found
    fix = next(how for t, _, how in capture_contract.CONTRACT if t.startswith(term))
    assert found[0].endswith(fix)


def test_unknown_runner_and_unreadable_settings_are_refused():
    model = nn.Sequential(nn.Linear(2, 2))
    for changes, why in (
        ({"compilation_config__cudagraph_mode": None}, None),  # eager: off
        (
            {
                "compilation_config__cudagraph_mode": None,
                "model_config__enforce_eager": False,
            },
            "cudagraph_mode unset without enforce_eager",
        ),
    ):
        found = capture_contract.violations(_config(**changes), CPUModelRunner(), model)
        assert (found == []) if why is None else why in found[0]
    for where, attribute, why in (
        ("pass_config", "enable_sp", "no sequence-parallelism flag to read"),
        ("parallel_config", "enable_dbo", "no enable_dbo to read"),
    ):
        config = _config()
        holder = (
            config.parallel_config
            if where == "parallel_config"
            else (config.compilation_config.pass_config)
        )
        delattr(holder, attribute)
        found = capture_contract.violations(config, CPUModelRunner(), model)
        assert why in found[0], found
    assert capture_contract.violations(_config(), object(), model)[0].startswith(
        "a known model runner"
    )
    config = _config()
    del config.compilation_config.mode
    found = capture_contract.violations(config, CPUModelRunner(), model)
    assert "no compilation mode or level to read" in found[0]


def test_no_sequence_parallel_flag_is_fine_only_once_the_pass_is_gone(monkeypatch):
    """vLLM 0.32 deleted the sequence-parallelism pass and its flag together."""
    model = nn.Sequential(nn.Linear(2, 2))
    config = _config()
    del config.compilation_config.pass_config.enable_sp
    assert capture_contract._sequence_parallel_passes()  # this vLLM has the pass
    found = capture_contract.violations(config, CPUModelRunner(), model)
    assert "sequence_parallelism.py" in found[0], found
    monkeypatch.setattr(capture_contract, "_sequence_parallel_passes", lambda: [])
    assert capture_contract.violations(config, CPUModelRunner(), model) == []


def test_float16_is_fine_without_a_rescaling_layer():
    for model in (nn.Sequential(nn.Linear(2, 2)), nn.Sequential(DeepseekLayer(1.0))):
        config = _config(model_config__dtype=torch.float16)
        assert capture_contract.violations(config, CPUModelRunner(), model) == []


class FakeDeepseekFp16Layer(nn.Module):
    """vLLM's DeepSeek decoder layer in float16, reduced to its overflow fix:
    the residual stream leaves the layer divided by routed_scaling_factor."""

    def __init__(self) -> None:
        super().__init__()
        self.routed_scaling_factor = 2.5
        self.mlp = nn.Linear(4, 4).half()

    def forward(self, hidden, residual):
        residual = hidden if residual is None else hidden + residual
        out = self.mlp(residual)
        if out.dtype == torch.float16:
            out = out / self.routed_scaling_factor
            residual = residual / self.routed_scaling_factor
        return out, residual


def test_the_fp16_rescaling_is_real_and_refused_at_setup():
    """What the contract guards against: the captured state scaled by 1/2.5,
    identical in direction (every cosine check passes) and refused at setup."""
    from specshim.job.verify.hf_reference import mismatch

    layer = FakeDeepseekFp16Layer()
    hidden = torch.randn(5, 4, dtype=torch.float16)
    out, residual = layer(hidden, None)
    captured = (out + residual).float()
    true = captured * layer.routed_scaling_factor
    cosine = torch.nn.functional.cosine_similarity(captured, true, dim=-1)
    assert bool((cosine > 0.999).all())  # direction alone cannot see it
    assert mismatch([captured], [true]) is not None  # the norm check does

    runner = CPUModelRunner()  # a runner the contract knows
    runner.model = nn.Sequential(layer)
    ext = SimpleNamespace(
        vllm_config=_config(model_config__dtype=torch.float16), model_runner=runner
    )
    calls = []
    setup = capture_contract._build(lambda self, ids: calls.append(ids))
    with pytest.raises(ValueError, match="run the model in bfloat16"):
        setup(ext, [1])
    assert calls == []  # refused before the capture was set up
