"""Tiny random-weight checkpoints with tokenizers, built offline.

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

_COMMON: dict[str, Any] = {
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


def _init_model(config: Any, model_cls: Callable[[Any], Any], seed: int) -> Any:
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


def _save(path: Path, config: Any, model_cls: Callable[[Any], Any], seed: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model = _init_model(config, model_cls, seed)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    return path


def build_llama(path: Path, seed: int = 0, **overrides: Any) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**_COMMON, **overrides}, architectures=["LlamaForCausalLM"])
    return _save(Path(path), config, LlamaForCausalLM, seed)


def build_qwen2(path: Path, seed: int = 0) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**_COMMON, architectures=["Qwen2ForCausalLM"])
    return _save(Path(path), config, Qwen2ForCausalLM, seed)


def deepseek_v3_config(**overrides: Any) -> dict[str, Any]:
    """A tiny DeepSeek-V3 MoE config (MLA dims, sigmoid routing, one dense layer)."""
    config = dict(_COMMON)
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
    out = _save(Path(path), config, DeepseekV3ForCausalLM, seed)
    # vLLM's loader reads these two keys to accept e_score_correction_bias.
    cfg_file = out / "config.json"
    data = json.loads(cfg_file.read_text())
    data.update(topk_method="noaux_tc", scoring_func="sigmoid")
    cfg_file.write_text(json.dumps(data, indent=2))
    return out


# --- Kimi-K2.5: a multimodal wrapper around a DeepSeek-V3 text model ---------
#
# What a Kimi-K2.5 checkpoint holds, in miniature:
# * ``config.json``: ``model_type: kimi_k25``, a DeepSeek-V3 ``text_config``, a
#   MoonViT ``vision_config``, the media placeholder id, and ``auto_map``
#   entries for the remote-code config (read by transformers' AutoConfig; vLLM
#   uses its own class) and image processor (vLLM loads it even for text);
# * text weights: HF ``DeepseekV3ForCausalLM`` names under ``language_model.``;
# * vision weights: vLLM's MoonViT names under ``vision_tower.``, projector
#   weights as ``mm_projector.proj.0`` / ``proj.2`` (vLLM maps them to
#   ``linear_1`` / ``linear_2``);
# * a tokenizer with the media special tokens.

KIMI_MEDIA_TOKENS = (
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_pad|>",
    "<|media_end|>",
    "<|kimi_k25_video_placeholder|>",
)

KIMI_VISION_CONFIG: dict[str, Any] = {
    "patch_size": 14,
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
    "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed",
    "num_attention_heads": 2,  # head_dim 32: vLLM's CPU attention rejects 16
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "merge_kernel_size": [2, 2],
    "video_attn_type": "spatial_temporal",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger",
    "mm_hidden_size": _COMMON["hidden_size"],
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
}


def moonvit_weight_shapes(vision: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the vision tower and projector tensors on disk."""
    hidden, mlp, patch = (
        vision["hidden_size"],
        vision["intermediate_size"],
        vision["patch_size"],
    )
    merged = hidden * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]
    shapes: dict[str, tuple[int, ...]] = {
        "vision_tower.patch_embed.proj.weight": (hidden, 3, patch, patch),
        "vision_tower.patch_embed.proj.bias": (hidden,),
        "vision_tower.patch_embed.pos_emb.weight": (
            vision["init_pos_emb_height"],
            vision["init_pos_emb_width"],
            hidden,
        ),
        "vision_tower.encoder.final_layernorm.weight": (hidden,),
        "vision_tower.encoder.final_layernorm.bias": (hidden,),
        "mm_projector.pre_norm.weight": (hidden,),
        "mm_projector.pre_norm.bias": (hidden,),
        "mm_projector.proj.0.weight": (merged, merged),
        "mm_projector.proj.0.bias": (merged,),
        "mm_projector.proj.2.weight": (vision["mm_hidden_size"], merged),
        "mm_projector.proj.2.bias": (vision["mm_hidden_size"],),
    }
    for i in range(vision["num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{i}"
        for norm in ("norm0", "norm1"):
            shapes[f"{block}.{norm}.weight"] = (hidden,)
            shapes[f"{block}.{norm}.bias"] = (hidden,)
        shapes[f"{block}.wqkv.weight"] = (3 * hidden, hidden)
        shapes[f"{block}.wqkv.bias"] = (3 * hidden,)
        shapes[f"{block}.wo.weight"] = (hidden, hidden)
        shapes[f"{block}.wo.bias"] = (hidden,)
        shapes[f"{block}.mlp.fc0.weight"] = (mlp, hidden)
        shapes[f"{block}.mlp.fc0.bias"] = (mlp,)
        shapes[f"{block}.mlp.fc1.weight"] = (hidden, mlp)
        shapes[f"{block}.mlp.fc1.bias"] = (hidden,)
    return shapes


def build_kimi_k25(path: Path, seed: int = 0, **text_overrides: Any) -> Path:
    """A tiny Kimi-K2.5 whose text weights equal ``build_deepseek_v3(seed)``'s."""
    import shutil
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from specshim.testing import kimi_k25_code

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text_config = deepseek_v3_config(**text_overrides)
    text = _init_model(DeepseekV3Config(**text_config), DeepseekV3ForCausalLM, seed)
    # The text weights as a checkpoint holds them: save_pretrained's names
    # (transformers 5 keeps MoE experts fused in memory and writes them per
    # expert), not the in-memory state_dict's.
    with tempfile.TemporaryDirectory() as scratch:
        text.save_pretrained(scratch, safe_serialization=True)
        saved = {}
        for shard in sorted(Path(scratch).glob("*.safetensors")):
            saved.update(load_file(str(shard)))
    tensors = {
        f"language_model.{name}": tensor.contiguous() for name, tensor in saved.items()
    }
    generator = torch.Generator().manual_seed(seed + 1)
    for name, shape in moonvit_weight_shapes(KIMI_VISION_CONFIG).items():
        tensors[name] = 0.02 * torch.randn(shape, generator=generator)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})

    build_tokenizer(path, extra_special=KIMI_MEDIA_TOKENS)
    media_pad = len(SPECIAL_TOKENS) + 256 + KIMI_MEDIA_TOKENS.index("<|media_pad|>")
    text_dict = text.config.to_dict()
    text_dict.update(topk_method="noaux_tc", scoring_func="sigmoid")
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "text_config": text_dict,
        "vision_config": KIMI_VISION_CONFIG,
        "media_placeholder_token_id": media_pad,
        "bos_token_id": _COMMON["bos_token_id"],
        "eos_token_id": _COMMON["eos_token_id"],
        "pad_token_id": _COMMON["pad_token_id"],
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    processor = "image_processing_kimi_k25.TinyKimiK25ImageProcessor"
    preprocessor = {
        "auto_map": {"AutoImageProcessor": processor},
        "image_processor_type": "TinyKimiK25ImageProcessor",
        "patch_size": KIMI_VISION_CONFIG["patch_size"],
        "merge_kernel_size": KIMI_VISION_CONFIG["merge_kernel_size"],
        # What vLLM 0.25+ builds its own (fused) Kimi-K2.5 processor from, as
        # the real checkpoint's preprocessor_config.json carries it; limits
        # sized for the tiny MoonViT.
        "media_proc_cfg": {
            "patch_size": KIMI_VISION_CONFIG["patch_size"],
            "merge_kernel_size": KIMI_VISION_CONFIG["merge_kernel_size"][0],
            "temporal_merge_kernel_size": 4,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "in_patch_limit": 64,
            "in_patch_limit_each_frame": 64,
            "in_patch_limit_video": None,
            "patch_limit_on_one_side": 8,
            "fixed_output_tokens": None,
        },
    }
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    code = Path(kimi_k25_code.__file__).parent
    for name in ("configuration_kimi_k25.py", "image_processing_kimi_k25.py"):
        shutil.copyfile(code / name, path / name)
    return path


# The latent width vLLM's CPU MLA kernels take (kv_lora_rank + qk_rope_head_dim
# = 512 + 64, as in DeepSeek-V3 and Kimi-K2.5); the small fixtures above (64)
# run with plain attention. These two run vLLM's real MLA path on its CPU
# backend where it has one.
MLA_WIDTH = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}


def build_deepseek_v3_mla(path: Path, seed: int = 0) -> Path:
    return build_deepseek_v3(path, seed, **MLA_WIDTH)


def build_kimi_k25_mla(path: Path, seed: int = 0) -> Path:
    """Its text weights equal ``build_deepseek_v3_mla(seed)``'s."""
    return build_kimi_k25(path, seed, **MLA_WIDTH)


BUILDERS: dict[str, Callable[..., Path]] = {
    "llama": build_llama,
    "qwen2": build_qwen2,
    "deepseek_v3": build_deepseek_v3,
    "kimi_k25": build_kimi_k25,
    "deepseek_v3_mla": build_deepseek_v3_mla,
    "kimi_k25_mla": build_kimi_k25_mla,
}
