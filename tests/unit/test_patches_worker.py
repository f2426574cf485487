"""Worker patches against small torch fakes: a Kimi-style wrapper around a
DeepSeek-style stack whose layers *require* ``llama_4_scaling`` (the nightly
shape), and a Llama-style stack."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
from torch import nn

from specshim.patches import _util
from specshim.patches.worker import (
    capture_hooks,
    captured_layout_rpc,
    eagle3_gate,
    row_layout,
)


class Layer(nn.Module):
    """(positions, hidden_states, residual, llama_4_scaling) -> (hidden, residual)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(8, 8)

    def forward(self, positions, hidden_states, residual, llama_4_scaling):
        residual = hidden_states if residual is None else hidden_states + residual
        out = self.proj(residual)
        if llama_4_scaling is not None:
            out = out * llama_4_scaling
        return out, residual


class Stack(nn.Module):
    def __init__(self, n: int = 4, scaling: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(Layer(i) for i in range(n))
        self.norm = nn.LayerNorm(8)
        self.start_layer, self.end_layer = 0, n
        self.scaling = scaling

    def forward(self, input_ids, positions):
        hidden, residual = self.embed(input_ids), None
        scale = (1 + 0.1 * positions.float()).unsqueeze(-1) if self.scaling else None
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden, residual = layer(positions, hidden, residual, scale)
        return self.norm(hidden + residual)

    def expected(self, input_ids, positions, index):
        """What capture must equal: hidden + residual after layer ``index``."""
        hidden, residual = self.embed(input_ids), None
        scale = (1 + 0.1 * positions.float()).unsqueeze(-1) if self.scaling else None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, scale)
            if i == index:
                return hidden + residual


class CausalLM(nn.Module):
    def __init__(self, stack):
        super().__init__()
        self.model = stack


class KimiWrapper(nn.Module):
    """No ``.model``; the text model is behind get_language_model()."""

    def __init__(self, stack):
        super().__init__()
        self.language_model = CausalLM(stack)
        self.vision_tower = nn.Linear(2, 2)

    def get_language_model(self):
        return self.language_model


class Extension:
    """Stands in for the worker with speculators' extension mixed in."""

    def __init__(self, model):
        self.stored = []
        self.model_runner = SimpleNamespace(
            model=model,
            input_batch=SimpleNamespace(req_ids=[]),
            execute_model=self._execute,
        )

    def _store_captured_states(self, states):
        self.stored.append(states)

    def _execute(self, scheduler_output, intermediate_tensors=None):
        self.model_runner.input_batch.req_ids = list(scheduler_output.order)
        return self.model_runner.model_forward(scheduler_output.input_ids)


@pytest.fixture
def worker_module(monkeypatch):
    module = ModuleType(_util.WORKER)
    module.supports_eagle3 = eagle3_gate._build(lambda model: False)
    monkeypatch.setitem(sys.modules, _util.WORKER, module)
    monkeypatch.setattr(capture_hooks, "_tp_rank", lambda: 0)
    return module


@pytest.mark.parametrize("wrapper", [KimiWrapper, CausalLM])
@pytest.mark.parametrize("scaling", [True, False])
def test_hooks_capture_what_the_models_own_forward_computes(
    worker_module, wrapper, scaling
):
    stack = Stack(scaling=scaling)
    ext = Extension(wrapper(stack))
    capture_hooks.setup_hidden_states_capture(ext, [3, 1])
    ids = torch.tensor([1, 2, 3, 4, 5])
    positions = torch.arange(5)
    with torch.no_grad():
        stack(ids, positions)
        stack(ids[:2], positions[:2])
        assert len(ext.stored) == 2  # one store per forward
        for layer_slot, index in enumerate([1, 3]):  # ascending, as speculators
            assert torch.equal(
                ext.stored[0][layer_slot], stack.expected(ids, positions, index)
            )
        dropped = Stack(scaling=False)
        dropped.load_state_dict(stack.state_dict())
        if scaling:  # the check can fail: dropping the scaling changes the states
            assert not torch.allclose(
                ext.stored[0][1], dropped.expected(ids, positions, 3)
            )


def test_setup_twice_does_not_double_capture(worker_module):
    stack = Stack()
    ext = Extension(CausalLM(stack))
    capture_hooks.setup_hidden_states_capture(ext, [0, 2])
    capture_hooks.setup_hidden_states_capture(ext, [0, 2])
    with torch.no_grad():
        stack(torch.tensor([1, 2]), torch.arange(2))
    assert len(ext.stored) == 1 and len(ext.stored[0]) == 2


def test_only_tp_rank_zero_captures(worker_module, monkeypatch):
    monkeypatch.setattr(capture_hooks, "_tp_rank", lambda: 1)
    stack = Stack()
    ext = Extension(CausalLM(stack))
    capture_hooks.setup_hidden_states_capture(ext, [1])
    with torch.no_grad():
        stack(torch.tensor([1, 2]), torch.arange(2))
    assert ext.stored == []


def test_layout_is_recorded_per_step_in_batch_order(worker_module):
    stack = Stack()
    ext = Extension(CausalLM(stack))
    ext.model_runner.model_forward = lambda ids: None
    setup = row_layout.PATCH.build(capture_hooks.setup_hidden_states_capture)
    setup(ext, [1])
    setup(ext, [1])  # set up twice: the runner is still wrapped once
    step = SimpleNamespace(
        order=["req_0_1", "req_0_0"],
        input_ids=None,
        num_scheduled_tokens={"req_0_0": 3, "req_0_1": 2},
    )
    ext.model_runner.execute_model(step)
    assert captured_layout_rpc.captured_layout(ext) == [("req_0_1", 2), ("req_0_0", 3)]
    assert captured_layout_rpc.captured_layout(ext) == []  # fetched once


def test_layout_rpc_says_when_recording_is_not_armed():
    assert captured_layout_rpc.captured_layout(SimpleNamespace()) is None


def test_model_without_stack_is_refused(worker_module):
    ext = Extension(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="does not support hidden state extraction"):
        capture_hooks.setup_hidden_states_capture(ext, [0])


def test_eagle3_gate_accepts_structure_and_keeps_vllms_answer():
    gate = eagle3_gate._build(lambda model: isinstance(model, nn.Linear))
    assert gate(KimiWrapper(Stack()))
    assert gate(CausalLM(Stack()))
    assert gate(nn.Linear(1, 1))  # vLLM said yes
    assert not gate(nn.Conv1d(1, 1, 1))


def test_layer_state_never_aliases_the_models_tensors():
    hidden, residual = torch.ones(2, 3), torch.ones(2, 3)
    for output in ((hidden, residual), (hidden, None), (hidden,), hidden):
        state = capture_hooks.layer_state(output)
        assert state.data_ptr() not in (hidden.data_ptr(), residual.data_ptr())
    assert torch.equal(capture_hooks.layer_state((hidden, residual)), hidden + residual)
