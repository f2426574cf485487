"""Choosing what ``verify`` recomputes with, before anything is loaded."""

from __future__ import annotations

import json

import pytest

from specshim import SpecShimError
from specshim.cli import main
from specshim.job.verify import modes as _references

# DeepSeek-V3 / Kimi-K2.5's text model as its config.json declares it.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "torch_dtype": "bfloat16",
}


def _checkpoint(tmp_path, **config):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_parameter_estimate_covers_the_real_bounded_model(tiny_model_dir, name):
    from specshim.job.verify.hf_reference import HFReference

    path = tiny_model_dir(name)
    config = json.loads((path / "config.json").read_text())
    actual = sum(
        p.numel() for p in HFReference(str(path), layers_up_to=3).model.parameters()
    )
    lm_head = config["vocab_size"] * config["hidden_size"]
    estimate = _references.hf_parameters(config, 3)
    # The estimate leaves out the LM head (never run) and may round up a little.
    assert actual - lm_head <= estimate <= 1.2 * actual


def test_the_full_deepseek_v3_estimate_is_its_known_size():
    billions = _references.hf_parameters(DEEPSEEK_V3, 60) / 1e9
    assert 650 < billions < 700  # 671B, of which the LM head is 0.9B


def test_hf_on_a_model_that_cannot_fit_is_refused_and_auto_goes_solo(tmp_path):
    model = _checkpoint(tmp_path, **DEEPSEEK_V3)
    with pytest.raises(SpecShimError, match=r"need about .* GiB .* --reference solo"):
        _references.choose("hf", model, [2, 30, 58])
    mode, why = _references.choose("auto", model, [2, 30, 58])
    assert mode == "solo" and "GiB" in why
    assert _references.choose("solo", model, [2]) == ("solo", "asked for")


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"quantization_config": {"quant_method": "compressed-tensors"}}, "quantized"),
        ({"model_type": "kimi_k25"}, "cannot build model type 'kimi_k25'"),
    ],
)
def test_hf_refuses_what_it_cannot_compute_faithfully(tmp_path, extra, reason):
    small = dict(DEEPSEEK_V3, hidden_size=64, num_hidden_layers=2, **extra)
    model = _checkpoint(tmp_path, **small)
    assert reason in (_references.hf_refusal(model, [1]) or "")


def test_verify_hf_on_a_huge_config_only_checkpoint_refuses_without_loading(
    tmp_path, capsys
):
    import torch

    model = _checkpoint(tmp_path, **DEEPSEEK_V3)  # no weights at all
    out = tmp_path / "out"
    out.mkdir()
    (out / "data_config.json").write_text(
        json.dumps({"layers": [2, 30, 58], "max_model_len": 4096})
    )
    states = [torch.zeros(3, 8) for _ in range(3)]
    torch.save(
        {"input_ids": torch.arange(3), "hidden_states": states, "loss_mask": None},
        out / "data_0.pt",
    )
    code = main(
        ["verify", "--model", str(model), "--out", str(out), "--reference", "hf"]
    )
    err = capsys.readouterr().err
    assert code == 1, err
    assert "--reference hf cannot check" in err and "--reference solo" in err
