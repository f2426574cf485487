"""``make bench-gpu``'s models and data: random-weight bfloat16 checkpoints
with specshim's tiny tokenizer, built on the GPU, and random token ids."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

VOCAB = 32000

# Kimi-K2.5's attention and routing (DeepSeek-V3 shape, 64 heads at full
# width): 576-wide MLA (kv_lora_rank 512 + rope 64), top-8 of its experts in
# one group, one shared expert, the first layer dense.
_KIMI = {
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.827,
}

# The two MoE models at 2,048 wide: 12 layers, 16 heads.
_NARROW_MOE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
}

# name: (architecture, config overrides, layers captured (speculators 0.3.0 ids))
MODELS: dict[str, tuple[str, dict[str, Any], list[int]]] = {
    "llama-1b": (
        "llama",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
        },
        [2, 8, 14],
    ),
    "llama-8b": (
        "llama",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
        },
        [2, 16, 29],
    ),
    "deepseek-v3-moe": (
        "deepseek_v3",
        {
            **_NARROW_MOE,
            "moe_intermediate_size": 1024,
            "n_routed_experts": 32,
            "num_experts_per_tok": 4,
            "n_shared_experts": 1,
            "n_group": 4,
            "topk_group": 2,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "routed_scaling_factor": 2.5,
        },
        [2, 6, 9],
    ),
    # Kimi-K2.5's routing and attention at 2,048 wide: 64 experts, top-8.
    "kimi-mla": (
        "deepseek_v3",
        {
            **_KIMI,
            **_NARROW_MOE,
            "moe_intermediate_size": 768,
            "n_routed_experts": 64,
        },
        [2, 6, 9],
    ),
    # Kimi-K2.5's width (7,168, 64 heads, 2,048-wide experts) and its four
    # captured layers: 57,344 bytes of states a token, the flagship's. 64
    # experts, not 384; as many layers as fit one GPU at extract's memory
    # setting (``fitting_layers``: 18 on an H200), its weights drawn by vLLM
    # (``DUMMY_WEIGHTS``); 5 layers where it is built on the CPU.
    "kimi-width": (
        "deepseek_v3",
        {
            **_KIMI,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "num_hidden_layers": 5,
            "num_attention_heads": 64,
            "num_key_value_heads": 64,
            "moe_intermediate_size": 2048,
            "n_routed_experts": 64,
        },
        [1, 2, 3, 4],
    ),
}

# Samples per model where 1,024 would not fit the lent host's 64 GB disk
# (kimi-width: 57 KB of states a token, 26 GB for 512 samples).
SAMPLES = {"kimi-width": 512}

# Models whose weights vLLM draws itself (``load_format="dummy"``): no
# checkpoint on the disk, so the model is as deep as the GPU holds, not as the
# lent host's 64 GB disk and a session's minutes allow. The checkpoint folder
# holds the config and the tokenizer only.
DUMMY_WEIGHTS = {"kimi-width"}

# What a step of extract needs beside the weights at 32,768 tokens on a
# Kimi-width model: activations, the MoE kernels' buffers, the captured states
# of a step and a batch's KV cache (bytes; generous).
_HEADROOM = 16 << 30


def layer_parameters(overrides: dict[str, Any]) -> tuple[int, int, int]:
    """A DeepSeek-V3 model's parameters: (a dense layer, a MoE layer, the
    embeddings and head), as transformers builds them."""
    c = {**_deepseek_defaults(), **overrides}
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attention = (
        h * c["q_lora_rank"]
        + c["q_lora_rank"]
        + c["q_lora_rank"] * heads * qk
        + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
        + c["kv_lora_rank"]
        + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
        + heads * c["v_head_dim"] * h
    )
    norms = 2 * h
    dense = attention + norms + 3 * h * c["intermediate_size"]
    experts = c["n_routed_experts"] + c["n_shared_experts"]
    moe = attention + norms + 3 * h * c["moe_intermediate_size"] * experts
    moe += c["n_routed_experts"] * h  # the router (its bias is a buffer)
    embeddings = 2 * c["vocab_size"] * h + h  # embed, lm_head, final norm
    return dense, moe, embeddings


def fitting_layers(
    overrides: dict[str, Any], gpu_bytes: int, utilization: float = 0.8
) -> int:
    """How many layers of this DeepSeek-V3 model fit ``gpu_bytes`` at vLLM's
    ``gpu_memory_utilization`` (bfloat16 weights, ``_HEADROOM`` for a step)."""
    dense, moe, embeddings = layer_parameters(overrides)
    first = overrides.get("first_k_dense_replace", 1)
    room = int(gpu_bytes * utilization) - _HEADROOM
    room -= 2 * (embeddings + first * dense)
    return first + max(0, room // (2 * moe))


def _deepseek_defaults() -> dict[str, Any]:
    from specshim.job.inputs.tiny_checkpoints import COMMON, deepseek_v3_config

    return deepseek_v3_config(**{**COMMON, "vocab_size": VOCAB})


def state_bytes_per_token(model: str) -> int:
    _, overrides, layers = MODELS[model]
    return len(layers) * overrides["hidden_size"] * 2  # bfloat16


def build_model(name: str, path: Path) -> Path:
    """A random-weight bfloat16 checkpoint with specshim's tiny tokenizer."""
    if (path / "config.json").exists():
        return path
    import torch
    import transformers

    from specshim.job.inputs.tiny_checkpoints import (
        COMMON,
        build_tokenizer,
        deepseek_v3_config,
    )

    arch, overrides, _ = MODELS[name]
    if name in DUMMY_WEIGHTS:
        total = torch.cuda.get_device_properties(0).total_memory
        overrides = {**overrides, "num_hidden_layers": fitting_layers(overrides, total)}
    common = {**COMMON, "vocab_size": VOCAB, "max_position_embeddings": 4096}
    if arch == "llama":
        config = transformers.LlamaConfig(
            **{**common, **overrides}, architectures=["LlamaForCausalLM"]
        )
    else:
        config = transformers.DeepseekV3Config(
            **deepseek_v3_config(**{**common, **overrides})
        )
    if name in DUMMY_WEIGHTS:  # vLLM draws the weights: the config is enough
        config.save_pretrained(path)
    else:
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)  # bfloat16: half the memory
        with torch.device("cuda"):
            model = getattr(transformers, config.architectures[0])(config)
        model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
        del model
    build_tokenizer(path)
    saved = json.loads((path / "config.json").read_text())
    saved.update(torch_dtype="bfloat16", dtype="bfloat16")
    if arch == "deepseek_v3":  # vLLM's loader reads these to accept the bias
        saved.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    return path


def build_data(path: Path, samples: int) -> list[list[int]]:
    """Samples of 256 to 1,535 random token ids (seed 0), as extract's JSONL."""
    rng = random.Random(0)
    data = [
        [rng.randrange(300, VOCAB) for _ in range(rng.randint(256, 1535))]
        for _ in range(samples)
    ]
    with path.open("w") as handle:
        for ids in data:
            handle.write(json.dumps({"input_ids": ids}) + "\n")
    return data
