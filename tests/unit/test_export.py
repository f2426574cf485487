"""``specshim export`` on an extract written by the real pipeline with a
stand-in generator (states that are a function of layer and token): the
layout, the layer mapping, resuming, and what it refuses. The newest
speculators' own reader of the result runs in tests/export (``make
test-export``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from specshim._base import UsageError
from specshim.job.export.command import ExportOptions, export
from specshim.job.extract import command as _extract
from specshim.job.extract.options import ExtractOptions
from specshim.job.inputs.checkpoint import hidden_size

LAYERS = [1, 3, 5]  # the tiny Llama has 6 decoder layers: 5 is the final one


class LayeredGenerator:
    """Layer k's state of token t is [t, k, 0, ...] (exact in bfloat16), as
    wide as the model's hidden size, which export checks."""

    def __init__(self, layers: list[int], width: int) -> None:
        self.layers = layers
        self.width = width
        self.executor = self

    def generate(self, batch: list[list[int]]) -> list[dict[str, Any]]:
        pad = [0] * (self.width - 2)
        return [
            {
                "input_ids": torch.tensor(ids),
                "hidden_states": [
                    torch.tensor([[t, k, *pad] for t in ids], dtype=torch.bfloat16)
                    for k in self.layers
                ],
            }
            for ids in batch
        ]

    def shutdown(self) -> None:
        pass


@pytest.fixture
def source(tmp_path, tiny_model_dir, monkeypatch):
    def make(layers=LAYERS, samples=5, name="hs"):
        model = tiny_model_dir("llama")
        monkeypatch.setattr(
            _extract,
            "_make_generator",
            lambda plan: LayeredGenerator(list(plan.layers), hidden_size(model)),
        )
        monkeypatch.setattr(_extract, "on_cpu", lambda: False)
        data = tmp_path / f"{name}.jsonl"
        data.write_text(
            "".join(
                json.dumps({"input_ids": list(range(1, 3 + i))}) + "\n"
                for i in range(samples)
            )
        )
        out = tmp_path / name
        _extract.extract(
            ExtractOptions(model=model, data=data, out=out, layers=layers, batch_size=2)
        )
        return model, out

    return make


def test_the_export_is_the_layout_and_mapping_the_newer_trainer_reads(source, tmp_path):
    from datasets import load_from_disk
    from safetensors.torch import load_file

    model, out = source()
    dest = tmp_path / "new"
    counts = export(ExportOptions(out=out, dest=dest, model=model))
    assert (counts["samples"], counts["written"], counts["kept"]) == (5, 5, 0)
    marker = json.loads((dest / "specshim_export.json").read_text())
    mapping = marker["layer_mapping"]
    assert mapping["layer_ids"] == [2, 4, 6]  # output of layer k = input of k + 1
    assert mapping["target_layer_ids"] == [2, 4] and mapping["verifier_last_slot"] == 6
    assert marker["train_with"].endswith("--target-layer-ids 2,4")
    table = load_from_disk(str(dest))
    assert table.format["type"] == "torch" and len(table) == 5
    for i in range(5):
        ids = list(range(1, 3 + i))
        row = table[i]
        assert row["input_ids"].tolist() == ids and int(row["seq_len"]) == len(ids)
        assert row["loss_mask"].tolist() == [1] * len(ids)
        stored = load_file(str(dest / "hidden_states" / f"hs_{i}.safetensors"))
        assert stored["token_ids"].dtype == torch.int64
        assert stored["token_ids"].tolist() == ids
        states = stored["hidden_states"]
        assert states.dtype == torch.bfloat16 and tuple(states.shape) == (
            len(ids),
            3,
            hidden_size(model),
        )
        for slot, k in enumerate(LAYERS):  # slots in layer order, final one last
            assert states[:, slot, 0].tolist() == ids
            assert states[:, slot, 1].tolist() == [k] * len(ids)


def test_a_rerun_keeps_what_is_checked_and_rewrites_what_changed(source, tmp_path):
    model, out = source()
    dest = tmp_path / "new"
    export(ExportOptions(out=out, dest=dest, model=model))
    (dest / "hidden_states" / "hs_3.safetensors").unlink()
    counts = export(ExportOptions(out=out, dest=dest, model=model))
    assert (counts["written"], counts["kept"]) == (1, 4)
    with pytest.raises(UsageError, match="export of other settings"):
        export(ExportOptions(out=out, dest=dest, model=model, dtype="float32"))


def test_a_layer_set_without_the_final_layer_is_refused(source, tmp_path):
    model, out = source(layers=[1, 3, 4])
    with pytest.raises(UsageError, match="not the model's final decoder layer 5"):
        export(ExportOptions(out=out, dest=tmp_path / "new", model=model))
    assert not (tmp_path / "new").exists()


def test_an_incomplete_extract_is_refused(source, tmp_path):
    model, out = source()
    (out / "data_2.pt").unlink()
    with pytest.raises(UsageError, match=r"not a complete extract \(1 missing"):
        export(ExportOptions(out=out, dest=tmp_path / "new", model=model))


def test_float32_states_are_the_source_converted(source, tmp_path):
    from safetensors.torch import load_file

    model, out = source()
    dest = tmp_path / "f32"
    export(ExportOptions(out=out, dest=dest, model=model, dtype="float32"))
    stored = load_file(str(dest / "hidden_states" / "hs_0.safetensors"))
    original = torch.load(out / "data_0.pt", weights_only=True)["hidden_states"]
    assert torch.equal(stored["hidden_states"], torch.stack(original, 1).float())


def test_another_directory_is_never_written_into(source, tmp_path):
    model, out = source()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="is not a specshim export"):
        export(ExportOptions(out=out, dest=other, model=model))
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


def test_the_cli_says_how_to_train(source, tmp_path, capsys):
    from specshim.cli import main

    model, out = source()
    code = main(
        ["export", "--out", str(out), "--to", "speculators", str(tmp_path / "n")]
        + ["--model", str(model)]
    )
    assert code == 0
    said = capsys.readouterr().out
    assert "5 samples" in said and "--target-layer-ids 2,4" in said
    assert Path(tmp_path / "n" / "specshim_export.json").is_file()


def test_fp8_is_what_speculators_fp8_backend_dequantizes_and_its_cost_is_said(
    source, tmp_path
):
    """float8 e4m3 with one float32 scale per token over all its layers: the
    file holds both, a reader's fp8 * scale is close to the source, and the
    export reports how close, per layer."""
    from safetensors.torch import load_file

    model, out = source()
    dest = tmp_path / "fp8"
    counts = export(ExportOptions(out=out, dest=dest, model=model, dtype="fp8"))
    assert counts["train_with"].endswith("--hidden-states-backend fp8")
    stored = load_file(str(dest / "hidden_states" / "hs_4.safetensors"))
    assert stored["hidden_states"].dtype == torch.float8_e4m3fn
    scales = stored["hidden_states_scales"]
    assert scales.dtype == torch.float32 and tuple(scales.shape) == (6, 1, 1)
    back = stored["hidden_states"].float() * scales
    original = torch.stack(
        torch.load(out / "data_4.pt", weights_only=True)["hidden_states"], 1
    ).float()
    assert torch.allclose(back, original, rtol=0.07, atol=0)  # e4m3: 3 mantissa bits
    assert not torch.equal(back, original)  # it is lossy, hence the report
    marker = json.loads((dest / "specshim_export.json").read_text())
    assert marker["agreement"] == counts["agreement"] and len(counts["agreement"]) == 3
    for row in counts["agreement"]:
        assert 0.99 < row["lowest_cosine"] <= row["mean_cosine"] <= 1.0
        assert abs(row["mean_norm_ratio"] - 1) < 0.05
    # Kept files keep their recorded agreement: a rerun reports the same.
    again = export(ExportOptions(out=out, dest=dest, model=model, dtype="fp8"))
    assert again["kept"] == 5 and again["agreement"] == counts["agreement"]


def test_a_checkpoint_other_than_the_extracted_one_is_refused(
    source, tmp_path, tiny_model_dir
):
    """Its layer count would decide the mapping: the fingerprint must match."""
    _, out = source()
    other = tiny_model_dir("qwen2")
    with pytest.raises(UsageError, match="is not the checkpoint .* extracted with"):
        export(ExportOptions(out=out, dest=tmp_path / "new", model=other))
    assert not (tmp_path / "new").exists()


def test_files_of_samples_the_source_no_longer_has_are_removed(source, tmp_path):
    model, longer = source(samples=5, name="long")
    dest = tmp_path / "new"
    export(ExportOptions(out=longer, dest=dest, model=model))
    (dest / "hidden_states" / ".hs_0.safetensors.partial").write_bytes(b"cut")
    _, shorter = source(samples=3, name="short")
    counts = export(ExportOptions(out=shorter, dest=dest, model=model))
    assert counts["samples"] == 3
    assert sorted(p.name for p in (dest / "hidden_states").iterdir()) == [
        f"hs_{i}.safetensors" for i in range(3)
    ]


@pytest.mark.parametrize("blocked", ["a file named hidden_states", "read-only"])
def test_a_dest_that_cannot_be_written_is_one_line(
    source, tmp_path, monkeypatch, capsys, blocked
):
    """Each was a FileExistsError or PermissionError traceback (issue 48)."""
    from specshim.cli import main

    model, out = source()
    dest = tmp_path / "dest"
    assert export(ExportOptions(out=out, dest=dest, model=model))["written"] == 5
    if blocked == "read-only":  # as a user without write access meets it
        real = Path.touch

        def touch(self, *args, **kwargs):
            if self.parent.parent == dest:
                raise PermissionError(13, "Permission denied")
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Path, "touch", touch)
    else:
        shutil.rmtree(dest / "hidden_states")
        (dest / "hidden_states").write_text("not a folder")
    code = main(
        ["export", "--out", str(out), "--to", "speculators", str(dest)]
        + ["--model", str(model)]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    reason = "Permission denied" if blocked == "read-only" else "is a file"
    assert f"cannot export into {dest / 'hidden_states'}: {reason}" in err
