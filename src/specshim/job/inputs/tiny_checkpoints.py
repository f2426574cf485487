"""Tiny random-weight checkpoints with tokenizers, built offline: the model
``specshim demo`` runs on, and the base of the test fixtures
(``specshim.testing.tiny_models``).

Every builder writes a directory that both Hugging Face transformers and vLLM
load: ``config.json``, ``model.safetensors``, a byte-level tokenizer and a chat
template. Sizes respect vLLM's CPU backend (head_dim >= 32). Weights are seeded,
so a directory built twice is identical.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 320  # 256 byte tokens + specials + spare rows, like real vocabularies

COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 258,
    "torch_dtype": "float32",
}


def build_tokenizer(path: Path, extra_special: tuple[str, ...] = ()) -> None:
    """A byte-level BPE tokenizer with no merges: one token per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    specials = [*SPECIAL_TOKENS, *extra_special]
    for offset, token in enumerate(specials):
        vocab[token] = len(alphabet) + offset
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(path)


def init_model(config: Any, model_cls: Callable[[Any], Any], seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                # Random norm scales so layers differ visibly from each other.
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif "bias" in name:
                param.copy_(0.02 * torch.randn_like(param))
    return model


def save_model(
    path: Path, config: Any, model_cls: Callable[[Any], Any], seed: int
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model = init_model(config, model_cls, seed)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    return path


def build_llama(path: Path, seed: int = 0, **overrides: Any) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**COMMON, **overrides}, architectures=["LlamaForCausalLM"])
    return save_model(Path(path), config, LlamaForCausalLM, seed)


def build_qwen2(path: Path, seed: int = 0) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**COMMON, architectures=["Qwen2ForCausalLM"])
    return save_model(Path(path), config, Qwen2ForCausalLM, seed)


def deepseek_v3_config(**overrides: Any) -> dict[str, Any]:
    """A tiny DeepSeek-V3 MoE config (MLA dims, sigmoid routing, one dense layer)."""
    config = dict(COMMON)
    config.update(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        num_key_value_heads=4,
        intermediate_size=512,
        moe_intermediate_size=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        rope_scaling=None,
    )
    config.update(overrides)
    return config


def build_deepseek_v3(path: Path, seed: int = 0, **overrides: Any) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**deepseek_v3_config(**overrides))
    out = save_model(Path(path), config, DeepseekV3ForCausalLM, seed)
    # vLLM's loader reads these two keys to accept e_score_correction_bias.
    cfg_file = out / "config.json"
    data = json.loads(cfg_file.read_text())
    data.update(topk_method="noaux_tc", scoring_func="sigmoid")
    cfg_file.write_text(json.dumps(data, indent=2))
    return out
