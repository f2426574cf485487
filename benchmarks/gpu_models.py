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
    # captured layers: 57,344 bytes of states a token, the flagship's. Five
    # layers (25 GB): 64 experts, not 384, and 5 layers, not 61, so that the
    # checkpoint is built, loaded and written within a lent session.
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
# beside the checkpoint (kimi-width: 57 KB of states a token).
SAMPLES = {"kimi-width": 256}


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
    common = {**COMMON, "vocab_size": VOCAB, "max_position_embeddings": 4096}
    if arch == "llama":
        config = transformers.LlamaConfig(
            **{**common, **overrides}, architectures=["LlamaForCausalLM"]
        )
    else:
        config = transformers.DeepseekV3Config(
            **deepseek_v3_config(**{**common, **overrides})
        )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16: half the memory
    with torch.device("cuda"):
        model = getattr(transformers, config.architectures[0])(config)
    model = model.to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    saved = json.loads((path / "config.json").read_text())
    saved.update(torch_dtype="bfloat16", dtype="bfloat16")
    if arch == "deepseek_v3":  # vLLM's loader reads these to accept the bias
        saved.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    del model
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
