"""A Hugging Face forward with hooks: the reference for captured hidden states."""

from __future__ import annotations

from typing import Any


class HFReference:
    """Computes ``hidden_states + residual`` after chosen decoder layers with HF.

    A forward hook on ``model.model.layers[i]`` sees the layer's output, which in
    HF already includes the residual: exactly what vLLM's captured
    ``hidden_states + residual`` is (also for the last layer, where HF's own
    ``output_hidden_states`` would apply the final norm).
    """

    def __init__(self, model_path: str, dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, torch_dtype=getattr(torch, dtype)
        ).eval()

    def layers(self) -> Any:
        inner = self.model.model
        return getattr(inner, "layers", None) or inner.language_model.layers

    def states(self, input_ids: list[int], layer_ids: list[int]) -> list[Any]:
        torch = self.torch
        captured: dict[int, Any] = {}
        handles = []
        for index in layer_ids:
            def hook(module: Any, args: Any, output: Any, index: int = index) -> None:
                out = output[0] if isinstance(output, tuple) else output
                captured[index] = out[0].detach().float()

            handles.append(self.layers()[index].register_forward_hook(hook))
        try:
            with torch.no_grad():
                self.model(torch.tensor([input_ids]))
        finally:
            for handle in handles:
                handle.remove()
        return [captured[i] for i in sorted(layer_ids)]


def per_token_cosine(a: Any, b: Any) -> Any:
    import torch

    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
