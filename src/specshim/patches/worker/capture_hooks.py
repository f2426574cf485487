"""Capture with forward hooks on the model's own forward.

Why:
    speculators' ``_setup_hidden_states_capture`` takes ``model.model`` as the
    decoder stack and replaces its ``forward`` with a copy of a vLLM-0.11-era
    Llama forward. On vLLM 0.16 that copy breaks three ways:

    * multimodal wrappers (Kimi-K2.5, Qwen2.5/3-VL) have no ``.model``
      (AttributeError); the text stack is ``get_language_model().model``;
    * it calls ``self.get_input_embeddings(input_ids)``, renamed
      ``embed_input_ids`` (AttributeError during warm-up);
    * it calls ``layer(hidden_states=, positions=, residual=)``, but DeepSeek's
      decoder layer takes ``(positions, hidden_states, residual,
      llama_4_scaling)`` and its model forward computes ``llama_4_scaling``
      from the config (Mistral-Large-3-style configs); Llama forwards
      ``**extra_layer_kwargs`` and Qwen3-VL ``deepstack_input_embeds``. A
      nightly made ``llama_4_scaling`` required (TypeError); dropping it gives
      silently wrong states.

    Instead of replacing the forward, this setup leaves the model's own forward
    in place and registers forward hooks on the chosen decoder layers: each hook
    records ``hidden_states + residual`` (the layer's two outputs, before the
    final norm, exactly what speculators captures), and when the last chosen
    layer has run the per-forward list goes to speculators' own
    ``_store_captured_states``. Whatever the model's forward computes for its
    layers (scaling, extra kwargs) is honoured by construction. As in
    speculators, only tensor-parallel rank 0 captures. It replaces the setup
    outright, so it comes first among the patches on that method
    (``row-provenance`` wraps it).
Upstream change:
    vLLM 0.12 (``embed_input_ids``, DeepSeek layer signature), 0.15 (Llama
    ``extra_layer_kwargs``, Kimi-K2.5 wrapper), 0.16 nightly (required
    ``llama_4_scaling``).
Upstream PR:
    vllm-project/vllm#27583 (``get_input_embeddings`` renamed
    ``embed_input_ids``); the layer-signature changes: not found.
Remove when:
    speculators captures through hooks or vLLM's own aux-hidden-state API.
"""

from __future__ import annotations

import logging
from typing import Any

from specshim._types import Incompatible, NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import WORKER
from specshim.patches.worker._stack import find_decoder_stack

logger = logging.getLogger(__name__)


def layer_state(output: Any) -> Any:
    """``hidden_states + residual`` from a decoder layer's output, as a new tensor.

    The sum is already a fresh tensor; a lone output is cloned, since the model
    may reuse its buffer in the next layer.
    """
    if isinstance(output, tuple):
        hidden_states = output[0]
        residual = output[1] if len(output) > 1 else None
        if residual is not None:
            return hidden_states + residual
        return hidden_states.clone()
    return output.clone()


class _Capture:
    """Per-forward buffer filled by the layer hooks of one worker."""

    def __init__(self, extension: Any, layer_ids: list[int]) -> None:
        self.extension = extension
        self.layer_ids = layer_ids
        self.buffer: dict[int, Any] = {}

    def hook(self, index: int) -> Any:
        position = self.layer_ids.index(index)

        def on_output(module: Any, args: Any, output: Any) -> None:
            state = self.buffer[index] = layer_state(output)
            early = getattr(self.extension, "_specshim_early", None)
            if early is not None:  # state-transport's copy, made now
                early.on_layer(position, state)
            if len(self.buffer) == len(self.layer_ids):
                states = [self.buffer[i] for i in self.layer_ids]
                self.buffer = {}
                self.extension._store_captured_states(states)

        return on_output


def tp_rank() -> int:
    from vllm.distributed import get_tp_group

    return int(get_tp_group().rank_in_group)


def setup_hidden_states_capture(self: Any, layer_ids: list[int]) -> None:
    """Replacement for ``HiddenStatesWorkerExtension._setup_hidden_states_capture``."""
    import sys

    custom_worker = sys.modules[WORKER]
    self._layer_ids = frozenset(layer_ids)
    self._captured_states = None
    model = self.model_runner.model
    if not custom_worker.supports_eagle3(model):
        raise ValueError(
            f"Model {type(model).__name__} does not support hidden state extraction"
        )
    stack = find_decoder_stack(model)
    if stack is None:
        raise ValueError(
            f"specshim found no decoder stack (a module with .layers and .norm) "
            f"in {type(model).__name__}; cannot capture hidden states"
        )
    for handle in getattr(self, "_specshim_hooks", []):
        handle.remove()
    self._specshim_hooks = []
    start = getattr(stack, "start_layer", 0)
    end = getattr(stack, "end_layer", len(stack.layers))
    chosen = sorted(i for i in self._layer_ids if start <= i < end)
    if tp_rank() == 0 and chosen:
        capture = _Capture(self, chosen)
        for index in chosen:
            layer = stack.layers[index]
            self._specshim_hooks.append(
                layer.register_forward_hook(capture.hook(index))
            )
    logger.info(
        "Hidden states capture setup complete for layers %s (specshim hooks on %s)",
        sorted(layer_ids),
        type(stack).__name__,
    )


def _probe(original: Any) -> None:
    if original is None:
        raise Incompatible(
            "HiddenStatesWorkerExtension._setup_hidden_states_capture", "nothing"
        )
    from vllm.model_executor.models.llama import LlamaModel

    if hasattr(LlamaModel, "get_input_embeddings"):
        raise NotNeeded("vLLM models still have get_input_embeddings (pre-0.12)")


PATCH = declare(
    __name__,
    __doc__,
    id="capture-hooks",
    attribute="HiddenStatesWorkerExtension._setup_hidden_states_capture",
    versions=">=0.12",
    probe=_probe,
    build=lambda original: setup_hidden_states_capture,
    drift_rows=(12, 13, 14),
)
