"""Finding the decoder stack speculators captures from."""

from __future__ import annotations

from typing import Any


def find_decoder_stack(model: Any) -> Any | None:
    """The module holding ``layers`` and ``norm`` for a causal LM or a wrapper.

    Plain causal LMs keep it at ``model.model``. Multimodal wrappers (Kimi-K2.5,
    Qwen2.5/3-VL) have no ``.model``; their text model is
    ``model.get_language_model()``, whose ``.model`` is the stack.
    """
    get_language_model = getattr(model, "get_language_model", None)
    candidates = []
    if callable(get_language_model):
        language_model = get_language_model()
        candidates += [getattr(language_model, "model", None), language_model]
    candidates += [getattr(model, "model", None), model]
    for candidate in candidates:
        if candidate is None:
            continue
        layers = getattr(candidate, "layers", None)
        if layers is not None and hasattr(candidate, "norm") and len(layers) > 0:
            return candidate
    return None
