"""Record, with every captured row, the token and position it was computed from.

Why:
    speculators slices the captured rows into sequences by position: sequence
    i gets the next ``len(ids_i)`` rows. That is only right if the workers
    computed exactly those requests, whole, in input order. Nothing in vLLM
    promises it: the v1 scheduler (0.11 and later) schedules a request that
    does not fit the token budget after later, smaller ones; the V2 GPU model
    runner (0.22, the default for every model on GPU from 0.29) sorts a step's
    requests by token count and has no ``input_batch`` to read an order from;
    a partial or cached prefill, or padding, adds or removes rows.

    So the rows prove where they came from, from the forward pass itself and
    not from the runner's bookkeeping: a forward hook on the decoder stack's
    token embedding records the token ids the forward embeds, and a pre-hook
    on the first decoder layer records the positions and checks that the
    layer's input is exactly those embeddings (the same tensor, or an exact
    copy where a multimodal runner embeds outside the forward and passes
    ``inputs_embeds``). When the capture stores a forward's states, the
    (token ids, positions) pair is stored beside them, row for row; a forward
    whose rows cannot be tied to its tokens is stored as unprovable.
    ``row-provenance-rpc`` hands the record to ``generate-guard``, which
    proves every returned row from it or refuses. Only tensor-parallel rank 0
    records, as only it captures (every TP rank computes the same rows).
Upstream change:
    None by itself: vLLM 0.11's v1 scheduler reorders requests over the token
    budget; vLLM 0.22 adds the V2 model runner
    (``vllm/v1/worker/gpu/model_runner.py``), which sorts requests by token
    count before the forward.
Upstream PR:
    none: no single change (the V2 runner's ordering is shown by
    vllm-project/vllm#47381).
Remove when:
    speculators slices captured rows by request and checks them itself.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from specshim.patches._declare import declare
from specshim.patches._wrappers import require_callable
from specshim.patches.worker._stack import find_decoder_stack


class Provenance:
    """What each captured row of one worker was computed from, per forward.

    ``forwards`` holds one ``(token_ids, positions, rows, problem)`` entry per
    stored capture, in the order speculators concatenates the states;
    ``problem`` is None when the forward's rows are proven.
    """

    def __init__(self, positions_index: int, hidden_index: int) -> None:
        self.positions_index = positions_index
        self.hidden_index = hidden_index
        self.embedded: tuple[Any, Any] | None = None  # (ids, embeddings)
        self.pending: tuple[Any, Any] | None = None  # (ids, positions)
        self.problem: str | None = None
        self.forwards: list[tuple[Any, Any, int, str | None]] = []
        self.moved = 0  # runs state-transport moved into input order

    def on_embed(self, module: Any, args: Any, output: Any) -> None:
        if not args:  # called by keyword: the ids are not visible here
            self.embedded = None
            return
        self.embedded = (args[0].detach().reshape(-1).clone(), output)

    def on_first_layer(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        positions = _argument(args, kwargs, "positions", self.positions_index)
        hidden = _argument(args, kwargs, "hidden_states", self.hidden_index)
        embedded, self.embedded = self.embedded, None
        self.pending, self.problem = None, None
        if embedded is None:
            self.problem = "the forward embedded no token ids the hook could see"
            return
        ids, embeddings = embedded
        if hidden is not embeddings and not (
            hidden.shape == embeddings.shape and bool((hidden == embeddings).all())
        ):
            self.problem = (
                f"the first decoder layer got {tuple(hidden.shape)} rows that are "
                f"not the embeddings of the {ids.numel()} recorded token ids "
                "(padding, or a model that transforms its embeddings)"
            )
            return
        if positions.dim() == 2:  # M-RoPE: text rows carry one position thrice
            if not bool((positions == positions[0]).all()):
                self.problem = "multi-axis positions differ between axes"
                return
            positions = positions[0]
        self.pending = (ids, positions.detach().reshape(-1).clone())

    def on_store(self, states: list[Any]) -> None:
        rows = int(states[0].shape[0]) if states else 0
        pending, problem = self.pending, self.problem
        self.pending, self.problem = None, None
        if pending is None:
            self.forwards.append((None, None, rows, problem or "no provenance"))
        elif pending[0].numel() != rows or pending[1].numel() != rows:
            self.forwards.append(
                (
                    None,
                    None,
                    rows,
                    f"{rows} rows captured for {pending[0].numel()} embedded tokens",
                )
            )
        else:
            self.forwards.append((pending[0], pending[1], rows, None))

    def take(self) -> dict[str, Any]:
        """The record since the last call, on the CPU; clears it."""
        import torch

        forwards, self.forwards = self.forwards, []
        moved, self.moved = self.moved, 0
        proven = [f for f in forwards if f[3] is None]
        empty = torch.zeros(0, dtype=torch.long)
        return {
            "token_ids": torch.cat([f[0].long() for f in proven]).cpu()
            if proven
            else empty,
            "positions": torch.cat([f[1].long() for f in proven]).cpu()
            if proven
            else empty,
            "rows": [f[2] for f in forwards],
            "problems": [f[3] for f in forwards if f[3] is not None],
            "moved": moved,
        }


def _argument(args: Any, kwargs: dict[str, Any], name: str, index: int) -> Any:
    return kwargs[name] if name in kwargs else args[index]


def _parameter_index(layer: Any, name: str) -> int:
    names = [
        p.name
        for p in inspect.signature(layer.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if name not in names:
        raise ValueError(
            f"specshim cannot read {name!r} from {type(layer).__name__}.forward"
            f"{inspect.signature(layer.forward)}; it refuses to capture rows whose "
            "provenance it cannot record"
        )
    return names.index(name)


def _arm(extension: Any) -> None:
    """Install the provenance hooks on this worker's model (TP rank 0 only)."""
    for handle in getattr(extension, "_specshim_provenance_hooks", []):
        handle.remove()
    extension._specshim_provenance_hooks = []
    extension._specshim_provenance = None
    from specshim.patches.worker.capture_hooks import tp_rank

    if tp_rank() != 0:
        return
    model = extension.model_runner.model
    stack = find_decoder_stack(model)
    embed = getattr(stack, "embed_tokens", None)
    if stack is None or not hasattr(embed, "register_forward_hook"):
        raise ValueError(
            f"specshim cannot see which tokens {type(model).__name__} embeds (no "
            "decoder stack with an embed_tokens module); it refuses to capture "
            "rows whose provenance it cannot record"
        )
    first = stack.layers[getattr(stack, "start_layer", 0)]
    record = Provenance(
        _parameter_index(first, "positions"), _parameter_index(first, "hidden_states")
    )
    extension._specshim_provenance = record
    extension._specshim_provenance_hooks = [
        embed.register_forward_hook(record.on_embed),
        first.register_forward_pre_hook(record.on_first_layer, with_kwargs=True),
    ]


def _wrap_instance_methods(extension: Any) -> None:
    """Store provenance beside every capture; forget it on every reset."""
    if getattr(extension, "_specshim_provenance_wrapped", False):
        return
    store = extension._store_captured_states
    reset = extension._reset_capture

    def store_captured_states(states: Any) -> Any:
        record = extension._specshim_provenance
        if record is not None:
            record.on_store(states)
        return store(states)

    def reset_capture() -> Any:
        record = extension._specshim_provenance
        if record is not None:
            record.forwards, record.moved = [], 0
        return reset()

    extension._store_captured_states = store_captured_states
    extension._reset_capture = reset_capture
    extension._specshim_provenance_wrapped = True


def _build(original: Any) -> Any:
    @functools.wraps(original)
    def setup_hidden_states_capture(self: Any, layer_ids: list[int]) -> None:
        original(self, layer_ids)
        _arm(self)
        _wrap_instance_methods(self)

    setup_hidden_states_capture.__specshim__ = True  # type: ignore[attr-defined]
    return setup_hidden_states_capture


PATCH = declare(
    __name__,
    __doc__,
    id="row-provenance",
    attribute="HiddenStatesWorkerExtension._setup_hidden_states_capture",
    versions=">=0.11",
    probe=require_callable(
        "HiddenStatesWorkerExtension._setup_hidden_states_capture(layer_ids)"
    ),
    build=_build,
    drift_rows=(18,),
)
