"""What ``specshim verify`` recomputes stored samples with.

* ``hf``: a Hugging Face forward of the checkpoint, bounded to the decoder
  layers up to the deepest captured one, in the checkpoint's dtype. Its memory
  is estimated from ``config.json`` before anything is loaded; a model that
  will not fit, a quantized checkpoint, or an architecture transformers cannot
  build as a causal LM is refused with a sentence that names the solo mode.
* ``solo``: the same unmodified speculators generator, with the run's layers
  and ``max_model_len``, fed one sample at a time. A batch of one has no
  scheduling, no reordering and no neighbour to borrow rows from, so stored
  rows that equal a solo run of their sequence sit in the right place. It runs
  wherever ``extract`` runs: any model, any tensor-parallel size.
* ``auto``: ``hf`` if the bounded HF model fits, else ``solo``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specshim._base import SpecShimError

GIB = 1 << 30
# Of the memory available now, how much a bounded HF reference may take
# (activations, the reference states and the interpreter need the rest).
HF_SHARE = 0.8
_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}


def _text_config(model: Path) -> dict[str, Any]:
    from specshim.job.inputs.checkpoint import text_config

    return text_config(model)[1]


def hf_parameters(config: dict[str, Any], layers_up_to: int) -> int:
    """Parameters of the embedding and decoder layers 0..``layers_up_to``.

    From the config alone (no weights need to exist): attention (plain, GQA or
    multi-head latent), and a dense MLP or a mixture of experts per layer.
    """
    h = int(config["hidden_size"])
    heads = int(config.get("num_attention_heads") or 1)
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or h // heads)
    if config.get("kv_lora_rank"):
        nope = int(config.get("qk_nope_head_dim") or 0)
        rope = int(config.get("qk_rope_head_dim") or 0)
        v_dim = int(config.get("v_head_dim") or head_dim)
        q_lora = int(config.get("q_lora_rank") or 0)
        kv_lora = int(config["kv_lora_rank"])
        q = (
            h * q_lora + q_lora * heads * (nope + rope)
            if q_lora
            else h * heads * (nope + rope)
        )
        attention = q + h * (kv_lora + rope) + kv_lora * heads * (nope + v_dim)
        attention += heads * v_dim * h + q_lora + kv_lora  # and their norms
    else:
        attention = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    dense = 3 * h * int(config.get("intermediate_size") or 4 * h)
    experts = int(config.get("n_routed_experts") or config.get("num_experts") or 0)
    moe_size = int(config.get("moe_intermediate_size") or 0)
    shared = int(config.get("n_shared_experts") or 0)
    first_dense = int(config.get("first_k_dense_replace") or 0)
    total = int(config.get("vocab_size") or 0) * h + h  # embedding, final norm
    for index in range(layers_up_to + 1):
        if experts and moe_size and index >= first_dense:
            mlp = (experts + shared) * 3 * h * moe_size + h * experts
        else:
            mlp = dense
        total += attention + mlp + 2 * h
    return total


def hf_bytes(model: Path, layers_up_to: int) -> tuple[int, str]:
    """Bytes a bounded HF reference needs, and the dtype it loads in."""
    config = _text_config(model)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    size = _BYTES.get(dtype.replace("torch.", ""), 4)
    return hf_parameters(config, layers_up_to) * size, dtype.replace("torch.", "")


def available_memory() -> tuple[int, str]:
    """Memory a reference may use: free accelerator memory, else free RAM."""
    try:
        import torch

        if torch.cuda.is_available():
            free = sum(
                torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())
            )
            return free, f"{torch.cuda.device_count()} accelerator(s)"
    except Exception:  # noqa: BLE001 - no usable accelerator: the CPU's RAM
        pass
    from specshim.job.kv_cache import available_memory

    return available_memory(), "RAM"


def hf_refusal(model: Path, layers: list[int]) -> str | None:
    """Why a bounded HF reference cannot check this run, or None if it can."""
    config = _text_config(model)
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "quantized")
        return (
            f"the checkpoint is quantized ({method}); the HF reference would not "
            "compute what vLLM computes"
        )
    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        )
    except ImportError:  # pragma: no cover - transformers without the table
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = {}  # noqa: N806
    top = json.loads((model / "config.json").read_text(encoding="utf-8"))
    if top.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (
            f"transformers cannot build model type {top.get('model_type')!r} as a "
            "causal LM"
        )
    need, dtype = hf_bytes(model, max(layers))
    have, where = available_memory()
    if need > HF_SHARE * have:
        return (
            f"layers 0..{max(layers)} need about {need / GIB:,.1f} GiB in {dtype}, "
            f"and {where} has {have / GIB:,.1f} GiB available"
        )
    return None


def choose(mode: str, model: Path, layers: list[int]) -> tuple[str, str]:
    """(reference, why) for ``--reference mode``; raises if ``hf`` cannot run."""
    if mode == "solo":
        return "solo", "asked for"
    refusal = hf_refusal(model, layers)
    if mode == "hf":
        if refusal:
            raise SpecShimError(
                f"--reference hf cannot check {model}: {refusal}. Use --reference "
                "solo, which recomputes each sample alone through the same vLLM "
                "generator, where the data was made."
            )
        return "hf", "asked for"
    if refusal:
        return "solo", refusal
    need, dtype = hf_bytes(model, max(layers))
    return "hf", f"layers 0..{max(layers)} fit ({need / GIB:,.2f} GiB in {dtype})"


class HFBounded:
    """The HF reference, decoder layers 0..deepest only, in the checkpoint dtype."""

    def __init__(self, model: Path, layers: list[int]) -> None:
        from specshim.job.verify.hf_reference import HFReference

        _, dtype = hf_bytes(model, max(layers))
        self.reference = HFReference(str(model), dtype=dtype, layers_up_to=max(layers))

    def states(self, ids: list[int], layers: list[int]) -> list[Any]:
        return self.reference.states(ids, layers)

    def close(self) -> None:
        return None


class Solo:
    """The run's own generator, one sample per ``generate()`` call."""

    def __init__(
        self, model: Path, layers: list[int], max_model_len: int, tp: int
    ) -> None:
        from speculators.data_generation import VllmHiddenStatesGenerator

        import specshim  # noqa: F401  (arms the patches before speculators loads)
        from specshim.job.kv_cache import VARIABLE, cpu_kv_cache_space

        self.layers = layers
        # One sequence at a time: 1 GiB of CPU KV cache, unless the user set it.
        given = os.environ.get(VARIABLE, "").strip()
        with cpu_kv_cache_space(None if given else 1):
            self.generator = VllmHiddenStatesGenerator(
                str(model),
                layer_ids=layers,
                max_model_len=max_model_len,
                tensor_parallel_size=tp,
            )

    def states(self, ids: list[int], layers: list[int]) -> list[Any]:
        if layers != self.layers:
            raise SpecShimError(f"solo reference built for layers {self.layers}")
        (result,) = self.generator.generate([ids])
        return [h.float() for h in result["hidden_states"]]

    def close(self) -> None:
        self.generator.executor.shutdown()
