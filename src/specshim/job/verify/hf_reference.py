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

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        apply_llama_4_scaling: bool = False,
        layers_up_to: int | None = None,
    ) -> None:
        """``layers_up_to=k`` loads decoder layers 0..k only (what capturing
        layer k needs); the rest of the checkpoint is never materialised."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.torch = torch
        kwargs: dict[str, Any] = {"torch_dtype": getattr(torch, dtype)}
        if layers_up_to is not None:
            config = AutoConfig.from_pretrained(model_path)
            config.num_hidden_layers = layers_up_to + 1
            kwargs["config"] = config
        self.model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).eval()
        if apply_llama_4_scaling:
            self._add_llama_4_scaling(self.model.config.llama_4_scaling)

    def _add_llama_4_scaling(self, scaling: dict[str, Any]) -> None:
        """Scale each token's attention query as Mistral-Large-3-style configs do.

        transformers' DeepSeek-V3 ignores ``llama_4_scaling``; vLLM multiplies
        the whole query of the token at position ``p`` by
        ``1 + beta * log(1 + floor(p / original_max_position_embeddings))``.
        Rotary embedding is linear per position, so scaling the query
        projection's output is the same thing.
        """
        torch = self.torch
        beta = float(scaling["beta"])
        original = int(scaling["original_max_position_embeddings"])

        def scale_query(module: Any, args: Any, output: Any) -> Any:
            positions = torch.arange(output.shape[-2], dtype=torch.float32)
            factor = 1 + beta * torch.log1p(torch.floor(positions / original))
            return output * factor[:, None].to(output.dtype)

        for layer in self.layers():
            attention = layer.self_attn
            query = getattr(attention, "q_b_proj", None) or attention.q_proj
            query.register_forward_hook(scale_query)

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


def _both_zero(a: Any, b: Any) -> Any:
    """Tokens whose state is the zero vector on both sides. A token whose
    embedding row is zero (a padding id) keeps a zero state through
    bias-free layers; two zero vectors agree exactly, though their cosine
    is undefined (torch gives 0)."""
    return (a.float().norm(dim=-1) == 0) & (b.float().norm(dim=-1) == 0)


def per_token_cosine(a: Any, b: Any) -> Any:
    """Per token: the cosine of the two states; 1 where both are zero, 0
    where only one is."""
    import torch

    cos = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
    return torch.where(_both_zero(a, b), torch.ones_like(cos), cos)


def norm_ratio(got: Any, want: Any) -> Any:
    """Per token: the captured state's length over the reference's; 1 where
    both are zero."""
    import torch

    ratio = got.float().norm(dim=-1) / want.float().norm(dim=-1).clamp_min(1e-12)
    return torch.where(_both_zero(got, want), torch.ones_like(ratio), ratio)


MEAN_COSINE = 0.98
TOKEN_COSINE = 0.95
# Tokens allowed under TOKEN_COSINE: 10% of the sequence, and at least one.
# bfloat16 MoE routing flips single near-tie tokens (seen: cosine 0.91 at one
# token of a 9-token sequence of a tiny DeepSeek, the same whether the sequence
# ran alone or in a batch of 70), so a short sequence is allowed one such token.
# The mean bar applies to every sequence; misplaced rows score near 0 on most
# tokens and fail both bars.
SHARE_BELOW = 0.1
# Cosine is blind to a constant factor (float16 DeepSeek layers capture the
# state times 1/routed_scaling_factor): lengths are compared too. Tokens whose
# norm is off by more than TOKEN_NORM get the same allowance as low-cosine
# ones (a routing flip moves both); the sequence's mean ratio must be within
# MEAN_NORM of 1. Measured on the tiny models (bfloat16 vLLM vs float32 HF,
# 40,794 tokens a model): Llama ratios 0.993-1.001; DeepSeek-V3 one token in
# 40,794 off by over 10%, sequence means within 0.3%.
TOKEN_NORM = 0.1
MEAN_NORM = 0.05


def mismatch(captured: list[Any], expected: list[Any]) -> str | None:
    """None if captured layers match the reference per token, else why not.

    Direction (cosine) and length (norm ratio) are both checked, per token and
    per sequence.
    """
    if len(captured) != len(expected):
        return f"{len(captured)} layers captured, {len(expected)} expected"
    for k, (got, want) in enumerate(zip(captured, expected, strict=True)):
        if tuple(got.shape) != tuple(want.shape):
            return f"layer #{k}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        cos = per_token_cosine(got, want)
        ratio = norm_ratio(got, want)
        mean = cos.mean().item()
        mean_ratio = ratio.mean().item()
        low = int((cos < TOKEN_COSINE).sum().item())
        off = int(((ratio - 1).abs() > TOKEN_NORM).sum().item())
        allowed = max(1, int(SHARE_BELOW * len(cos)))
        if mean < MEAN_COSINE or low > allowed:
            return (
                f"layer #{k}: mean cosine {mean:.4f}, {low} of {len(cos)} tokens "
                f"under {TOKEN_COSINE} (allowed {allowed})"
            )
        if abs(mean_ratio - 1) > MEAN_NORM or off > allowed:
            return (
                f"layer #{k}: mean norm ratio {mean_ratio:.3f}, {off} of {len(cos)} "
                f"tokens off in norm by over {TOKEN_NORM:.0%} (allowed {allowed})"
            )
    return None
