"""Worker patches against small torch fakes: a Kimi-style wrapper around a
DeepSeek-style stack whose layers *require* ``llama_4_scaling`` (the nightly
shape), and a Llama-style stack."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
from torch import nn

from specshim import SpecShimError
from specshim.patches import _wrappers
from specshim.patches.main import generate_guard
from specshim.patches.worker import (
    capture_hooks,
    eagle3_gate,
    row_provenance,
    row_provenance_rpc,
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
        self.embed_tokens = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(Layer(i) for i in range(n))
        self.norm = nn.LayerNorm(8)
        self.start_layer, self.end_layer = 0, n
        self.scaling = scaling

    def forward(self, input_ids, positions):
        hidden, residual = self.embed_tokens(input_ids), None
        scale = (1 + 0.1 * positions.float()).unsqueeze(-1) if self.scaling else None
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden, residual = layer(positions, hidden, residual, scale)
        return self.norm(hidden + residual)

    def expected(self, input_ids, positions, index):
        """What capture must equal: hidden + residual after layer ``index``."""
        hidden, residual = self.embed_tokens(input_ids), None
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

    def _reset_capture(self):
        self.stored = []

    def _execute(self, scheduler_output, intermediate_tensors=None):
        self.model_runner.input_batch.req_ids = list(scheduler_output.order)
        return self.model_runner.model_forward(scheduler_output.input_ids)


@pytest.fixture
def worker_module(monkeypatch):
    module = ModuleType(_wrappers.WORKER)
    module.supports_eagle3 = eagle3_gate._build(lambda model: False)
    monkeypatch.setitem(sys.modules, _wrappers.WORKER, module)
    monkeypatch.setattr(capture_hooks, "tp_rank", lambda: 0)
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
    monkeypatch.setattr(capture_hooks, "tp_rank", lambda: 1)
    stack = Stack()
    ext = Extension(CausalLM(stack))
    capture_hooks.setup_hidden_states_capture(ext, [1])
    with torch.no_grad():
        stack(torch.tensor([1, 2]), torch.arange(2))
    assert ext.stored == []


class V2ShapedRunner:
    """A model runner shaped like vLLM's V2 GPU runner: no ``input_batch``; it
    sorts a step's requests by token count (longest first) before the forward.
    ``pad`` adds rows of token 0 at position 0; ``drop`` leaves the last
    request out; ``twice`` lays the first request out twice."""

    def __init__(self, stack, pad=0, drop=False, twice=False):
        self.stack, self.pad, self.drop, self.twice = stack, pad, drop, twice

    def execute(self, requests):
        order = sorted(requests, key=len, reverse=True)
        if self.drop:
            order = order[:-1]
        if self.twice:
            order = [order[0], *order]
        ids = [t for r in order for t in r] + [0] * self.pad
        positions = [p for r in order for p in range(len(r))] + [0] * self.pad
        with torch.no_grad():
            self.stack(torch.tensor(ids), torch.tensor(positions))


def _v2_generate(batch, steps=1, **runner):
    """speculators' generate() in miniature on the V2-shaped runner: capture,
    slice positionally, then the guard with the workers' provenance."""
    stack = Stack(scaling=False)
    ext = Extension(CausalLM(stack))
    setup = row_provenance.PATCH.build(capture_hooks.setup_hidden_states_capture)
    setup(ext, [1, 3])
    ext._reset_capture()
    v2 = V2ShapedRunner(stack, **runner)
    size = -(-len(batch) // steps)
    for start in range(0, len(batch), size):
        v2.execute(batch[start : start + size])
    captured = [torch.cat([s[k] for s in ext.stored]) for k in range(2)]
    results, offset = [], 0
    for ids in batch:  # speculators' positional slicing
        n = len(ids)
        results.append(
            {
                "input_ids": torch.tensor(ids),
                "hidden_states": [h[offset : offset + n] for h in captured],
            }
        )
        offset += n
    record = row_provenance_rpc.row_provenance(ext)
    begin = generate_guard.prove_rows(batch, record)
    return stack, generate_guard.reorder(results, batch, begin)


BATCH = [[1, 2, 3], [4, 5, 6, 7, 8], [1, 2, 3], [1, 2, 3, 9], [7], [3, 2]]


@pytest.mark.parametrize("steps", [1, 2])
def test_v2_shaped_runner_rows_come_back_in_input_order(worker_module, steps):
    stack, results = _v2_generate(BATCH, steps=steps)
    for ids, result in zip(BATCH, results, strict=True):
        ids_t = torch.tensor(ids)
        for slot, layer in enumerate([1, 3]):
            want = stack.expected(ids_t, torch.arange(len(ids)), layer)
            assert torch.allclose(result["hidden_states"][slot], want, atol=1e-6)


@pytest.mark.parametrize(
    ("runner", "message"),
    [
        ({"pad": 2}, "belong to no input sequence"),
        ({"drop": True}, "no rows computed for sequence"),
        ({"twice": True}, "belong to no input sequence"),
    ],
)
def test_v2_shaped_runner_that_pads_drops_or_repeats_is_refused(
    worker_module, runner, message
):
    with pytest.raises(SpecShimError, match=message):
        _v2_generate(BATCH, **runner)


def test_provenance_is_fetched_once_and_cleared_by_reset(worker_module):
    stack = Stack()
    ext = Extension(CausalLM(stack))
    setup = row_provenance.PATCH.build(capture_hooks.setup_hidden_states_capture)
    setup(ext, [1])
    setup(ext, [1])  # set up twice: one record, hooks installed once
    with torch.no_grad():
        stack(torch.tensor([5, 6, 7]), torch.arange(3))
    record = row_provenance_rpc.row_provenance(ext)
    assert record["token_ids"].tolist() == [5, 6, 7]
    assert record["positions"].tolist() == [0, 1, 2] and record["rows"] == [3]
    assert row_provenance_rpc.row_provenance(ext)["rows"] == []  # fetched once
    with torch.no_grad():
        stack(torch.tensor([5]), torch.arange(1))
    ext._reset_capture()
    assert row_provenance_rpc.row_provenance(ext)["rows"] == []


def test_rows_that_are_not_the_embeddings_are_unprovable(worker_module):
    """A forward whose first layer does not see the embedded rows (padding, or
    a runner that passes other ``inputs_embeds``) is recorded as unprovable."""
    stack = Stack()
    ext = Extension(CausalLM(stack))
    row_provenance.PATCH.build(capture_hooks.setup_hidden_states_capture)(ext, [1])
    stack.embed_tokens(torch.tensor([1, 2]))  # an embedding the forward never uses
    with torch.no_grad():
        hidden = torch.zeros(2, 8)
        for layer in stack.layers:
            hidden, residual = layer(torch.arange(2), hidden, None, None)
    record = row_provenance_rpc.row_provenance(ext)
    assert record["problems"] and "not the embeddings" in record["problems"][0]
    with pytest.raises(SpecShimError, match="no provable rows"):
        generate_guard.prove_rows([[1, 2]], record)


def test_provenance_rpc_says_when_recording_is_not_armed():
    assert row_provenance_rpc.row_provenance(SimpleNamespace()) is None


def test_model_whose_tokens_the_hooks_cannot_see_is_refused(worker_module):
    stack = Stack()
    del stack.embed_tokens
    ext = Extension(CausalLM(stack))
    setup = row_provenance.PATCH.build(capture_hooks.setup_hidden_states_capture)
    with pytest.raises(ValueError, match="cannot see which tokens"):
        setup(ext, [1])


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
