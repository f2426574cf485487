"""What the job reads from a checkpoint directory: its config (the text part
of multimodal wrappers), layer count and vocabulary, hidden size, KV-cache
bytes per token and a fingerprint by content (``ModelFacts``). What vLLM
would refuse of the job's flags for it is the plan's check
(``extract.plan.check_against_model``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specshim._base import UsageError

# Files that decide how a checkpoint tokenizes and what its model is.
MODEL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def text_config(model: Path, flag: str = "--model") -> tuple[Path, dict[str, Any]]:
    """The checkpoint's config.json, and its text part (multimodal wrappers)."""
    if not model.is_dir():
        raise UsageError(f"{flag} {model}: no such directory (a local checkpoint)")
    config_file = model / "config.json"
    if not config_file.is_file():
        raise UsageError(f"{flag} {model}: no config.json, not a checkpoint directory")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{config_file}: not a readable JSON file ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{config_file}: not a JSON object")
    return config_file, {**config, **(config.get("text_config") or {})}


def config_int(model: Path, *keys: str) -> tuple[int, ...]:
    return _ints(*text_config(model), *keys)


def _ints(config_file: Path, config: dict[str, Any], *keys: str) -> tuple[int, ...]:
    try:
        return tuple(int(config[key]) for key in keys)
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"{config_file}: cannot find {' and '.join(keys)}") from None


@dataclass(frozen=True)
class ModelFacts:
    """What an extract run needs of a checkpoint, read once (``read_model``)."""

    path: Path  # as given
    config_file: Path
    num_layers: int
    vocab_size: int
    # max_position_embeddings where vLLM takes it as the limit (no rope
    # scaling stretches it); None where the config leaves the limit to vLLM.
    positions: int | None
    attention_heads: int | None
    kv_bytes_per_token: int | None  # None: the config does not say enough
    fingerprint: str


def read_model(model: Path) -> ModelFacts:
    """The checkpoint's facts; refuses, naming --model, what is no checkpoint."""
    config_file, config = text_config(model)
    num_layers, vocab_size = _ints(
        config_file, config, "num_hidden_layers", "vocab_size"
    )
    positions = config.get("max_position_embeddings")
    # Where rope scaling stretches the positions, vLLM computes the limit.
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else "?"
    scaled = kind not in (None, "default")
    heads = config.get("num_attention_heads")
    return ModelFacts(
        path=model,
        config_file=config_file,
        num_layers=num_layers,
        vocab_size=vocab_size,
        positions=positions if isinstance(positions, int) and not scaled else None,
        attention_heads=heads if isinstance(heads, int) else None,
        kv_bytes_per_token=_kv_bytes_per_token(config),
        fingerprint=model_fingerprint(model),
    )


def model_facts(model: Path) -> tuple[int, int]:
    """(number of decoder layers, vocabulary size) from the checkpoint's config.json."""
    layers, vocab = config_int(model, "num_hidden_layers", "vocab_size")
    return layers, vocab


def hidden_size(model: Path) -> int:
    return config_int(model, "hidden_size")[0]


def choose_layers(requested: list[int] | None, num_layers: int) -> list[int]:
    """The requested layers, checked; or speculators 0.3.0's automatic choice."""
    if requested is None:
        # speculators' own default in VllmHiddenStatesGenerator.__init__, whose
        # ids coincide on small models (6 layers: 2, 3, 3, 5): each layer once.
        auto = [2, num_layers // 2, num_layers - 3, num_layers - 1]
        return sorted({i for i in auto if 0 <= i < num_layers})
    if not requested:
        raise UsageError("--layers is empty")
    bad = [i for i in requested if not 0 <= i < num_layers]
    if bad:
        raise UsageError(
            f"--layers {bad} out of range: the model has {num_layers} decoder "
            f"layers, valid ids are 0..{num_layers - 1}"
        )
    if len(set(requested)) != len(requested) or requested != sorted(requested):
        raise UsageError(
            f"--layers {requested}: give distinct ids in increasing order "
            "(captured states are stored in layer order)"
        )
    return requested


def model_fingerprint(model: Path) -> str:
    """The checkpoint by content: config, tokenizer files, weight file sizes.

    Not its path, so another mount point on another node is the same model.
    Weights are not read (too large); their names and sizes are taken.
    """
    import hashlib

    digest = hashlib.blake2b(digest_size=16)
    for name in MODEL_FILES:
        path = model / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    for path in sorted(model.glob("*.safetensors")) + sorted(model.glob("*.bin")):
        digest.update(f"{path.name}:{path.stat().st_size}\0".encode())
    return digest.hexdigest()


def _kv_bytes_per_token(config: dict[str, Any]) -> int | None:
    """An upper estimate of one token's KV cache (bfloat16, every layer); None
    where the config does not say enough.

    Multi-head latent attention runs as plain attention on the CPU backend
    (``VLLM_MLA_DISABLE``): K and V then span every head.
    """
    try:
        return _kv_bytes(config)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def _kv_bytes(config: dict[str, Any]) -> int:
    layers = int(config.get("num_hidden_layers", 1))
    heads = int(config.get("num_attention_heads", 1))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    if "kv_lora_rank" in config:
        nope = int(config.get("qk_nope_head_dim") or 0)
        rope = int(config.get("qk_rope_head_dim") or 0)
        v_dim = int(config.get("v_head_dim") or nope + rope)
        per_layer = heads * (max(nope + rope, v_dim) * 2)
    else:
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        per_layer = 2 * kv_heads * head_dim
    return layers * per_layer * 2
