"""Test fixtures: the tiny checkpoints of ``specshim.job.inputs.tiny_checkpoints``,
plus Kimi-K2.5 (a multimodal wrapper with remote code) and the 576-wide MLA
variants, built offline. Every builder writes a directory that both Hugging
Face transformers and vLLM load."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specshim.job.inputs.tiny_checkpoints import (
    CHAT_TEMPLATE,
    COMMON,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_deepseek_v3,
    build_llama,
    build_qwen2,
    build_tokenizer,
    deepseek_v3_config,
    init_model,
    save_model,
)

__all__ = [
    "BUILDERS",
    "CHAT_TEMPLATE",
    "MLA_WIDTH",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "WIDE_LAYERS",
    "build_deepseek_v3",
    "build_deepseek_v3_mla",
    "build_kimi_k25",
    "build_kimi_k25_mla",
    "build_llama",
    "build_llama_wide",
    "build_qwen2",
    "build_qwen3_moe",
    "build_tokenizer",
    "deepseek_v3_config",
]


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
    "mm_hidden_size": COMMON["hidden_size"],
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
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text_config = deepseek_v3_config(**text_overrides)
    text = init_model(DeepseekV3Config(**text_config), DeepseekV3ForCausalLM, seed)
    _write_kimi_weights(path, text, seed)

    build_tokenizer(path, extra_special=KIMI_MEDIA_TOKENS)
    (path / "config.json").write_text(json.dumps(_kimi_config(text), indent=2))
    preprocessor = _kimi_preprocessor_config()
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    _copy_kimi_code(path)
    return path


def _write_kimi_weights(path: Path, text: Any, seed: int) -> None:
    """``model.safetensors``: the text model under ``language_model.``, and a
    random MoonViT and projector (seeded by ``seed + 1``)."""
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

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


def _kimi_config(text: Any) -> dict[str, Any]:
    """``config.json``: the text model's config wrapped as ``kimi_k25``."""
    media_pad = len(SPECIAL_TOKENS) + 256 + KIMI_MEDIA_TOKENS.index("<|media_pad|>")
    text_dict = text.config.to_dict()
    text_dict.update(topk_method="noaux_tc", scoring_func="sigmoid")
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "text_config": text_dict,
        "vision_config": KIMI_VISION_CONFIG,
        "media_placeholder_token_id": media_pad,
        "bos_token_id": COMMON["bos_token_id"],
        "eos_token_id": COMMON["eos_token_id"],
        "pad_token_id": COMMON["pad_token_id"],
        "torch_dtype": "float32",
    }


def _kimi_preprocessor_config() -> dict[str, Any]:
    """``preprocessor_config.json``: the remote-code image processor."""
    processor = "image_processing_kimi_k25.TinyKimiK25ImageProcessor"
    return {
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


def _copy_kimi_code(path: Path) -> None:
    """The remote code the ``auto_map`` entries name, next to the weights."""
    import shutil

    from specshim.testing import kimi_k25_code

    code = Path(kimi_k25_code.__file__).parent
    for name in ("configuration_kimi_k25.py", "image_processing_kimi_k25.py"):
        shutil.copyfile(code / name, path / name)


# DeepSeek-V3's and Kimi-K2.5's attention geometry: the latent width vLLM's
# CPU MLA kernels take (kv_lora_rank + qk_rope_head_dim = 512 + 64), and their
# head dims (query/key 128 + 64, value 128), the shapes FlashAttention's MLA
# prefill takes on a GPU (a query/key of 96 with a value of 32 fails there once
# a prefill continues a cached context). The small fixtures above (latent 64)
# run with plain attention. These two run vLLM's real MLA path on its CPU
# backend where it has one, and on the GPU.
MLA_WIDTH = {
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}


def build_deepseek_v3_mla(path: Path, seed: int = 0) -> Path:
    return build_deepseek_v3(path, seed, **MLA_WIDTH)


def build_kimi_k25_mla(path: Path, seed: int = 0) -> Path:
    """Its text weights equal ``build_deepseek_v3_mla(seed)``'s."""
    return build_kimi_k25(path, seed, **MLA_WIDTH)


# A Llama 4x wider, half as deep, with a narrow MLP: a row of its states is
# 4 KiB a layer (float32), so replies of every size the state transport
# handles differently (1 MiB a layer, 24 MiB in all) take few tokens, which is
# what costs on a CPU.
WIDE_LAYERS = [0, 1, 2]


def build_llama_wide(path: Path, seed: int = 0) -> Path:
    return build_llama(
        path,
        seed,
        hidden_size=1024,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
    )


def build_qwen3_moe(path: Path, seed: int = 0) -> Path:
    """A tiny Qwen3-MoE: 8 experts, top 2, every layer sparse, q/k norms."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 6},
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        architectures=["Qwen3MoeForCausalLM"],
    )
    return save_model(Path(path), config, Qwen3MoeForCausalLM, seed)


BUILDERS: dict[str, Callable[..., Path]] = {
    "llama": build_llama,
    "llama_wide": build_llama_wide,
    "qwen2": build_qwen2,
    "qwen3_moe": build_qwen3_moe,
    "deepseek_v3": build_deepseek_v3,
    "kimi_k25": build_kimi_k25,
    "deepseek_v3_mla": build_deepseek_v3_mla,
    "kimi_k25_mla": build_kimi_k25_mla,
}
