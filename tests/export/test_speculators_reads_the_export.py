"""The newest speculators' own reader on ``specshim export``'s output.

A real extract (vLLM's CPU backend, unmodified speculators 0.3.0) of a tiny
Llama, exported, then read in the peer environment ``make test-export`` builds
(``requirements/export-peer.txt``) by speculators' ``ArrowDataset``: every
row must hold the source's tokens, loss mask and states, and its layers must
be, by HF's own modules, the states that trainer's convention names. Without
that environment (``SPECSHIM_EXPORT_PYTHON``) the tests are skipped, saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..e2e.test_extract import _command, _dataset, _run_ok

pytestmark = pytest.mark.export

PEER = os.environ.get("SPECSHIM_EXPORT_PYTHON")
READER = Path(__file__).with_name("read_with_speculators.py")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_dir):
    if not PEER:
        pytest.skip("needs the newest speculators' environment: `make test-export`")
    root = tmp_path_factory.mktemp("export")
    model = tiny_model_dir("llama")
    out, dest = root / "hs", root / "new"
    _run_ok(_command(model, _dataset(root / "d.jsonl", 9, 1, 200), out))
    for target, extra in ((dest, []), (root / "fp8", ["--dtype", "fp8"])):
        _run_ok(
            [sys.executable, "-m", "specshim", "export", "--out", str(out)]
            + ["--to", "speculators", str(target), *extra]
        )
    return model, out, dest


def _read(dest: Path, out: Path, model: Path, *extra: str) -> dict:
    run = subprocess.run(
        [str(PEER), str(READER), str(dest), str(out), str(model), *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_the_newest_speculators_reads_the_export(exported):
    model, out, dest = exported
    result = _read(dest, out, model)
    print("read with speculators", result["speculators"], result)
    assert result["rows"] == 9 and result["problems"] == []
    assert result["aux_ids"] == [2, 4]  # 0.3.0's 1 and 3, entering 2 and 4


def _copy(dest: Path, to: Path) -> Path:
    shutil.copytree(dest, to)
    return to


def test_ids_off_by_one_fail_the_check(exported, tmp_path):
    """The export records 0.3.0's own ids, unmapped: what training would be
    told no longer names the states stored."""
    model, out, dest = exported
    broken = _copy(dest, tmp_path / "ids")
    marker = broken / "specshim_export.json"
    data = json.loads(marker.read_text())
    data["layer_mapping"]["target_layer_ids"] = [1, 3]
    marker.write_text(json.dumps(data))
    result = _read(broken, out, model)
    assert result["problem_count"] >= 9, result
    assert "aux slot 0 is not the state entering layer 1" in result["problems"][0]


def test_slots_out_of_order_fail_the_check(exported, tmp_path):
    """The final layer not in the last slot: the trainer would take an
    auxiliary layer for the verifier's last hidden state."""
    import torch
    from safetensors.torch import load_file, save_file

    model, out, dest = exported
    broken = _copy(dest, tmp_path / "order")
    for path in (broken / "hidden_states").glob("hs_*.safetensors"):
        data = load_file(str(path))
        data["hidden_states"] = data["hidden_states"].flip(1).contiguous()
        save_file(data, str(path))
    source = torch.load(out / "data_0.pt", weights_only=True)
    assert not torch.equal(source["hidden_states"][0], source["hidden_states"][-1])
    result = _read(broken, out, model)
    assert result["problem_count"] >= 9, result
    assert any("last slot is not the final layer" in p for p in result["problems"])


def test_an_fp8_export_reads_through_speculators_fp8_backend(exported):
    """The states come back within the agreement bar (HF's layers included);
    how far from the source the export itself reported."""
    model, out, dest = exported
    fp8 = dest.parent / "fp8"
    result = _read(fp8, out, model, "fp8")
    print("fp8 read with speculators", result["speculators"], result)
    assert result["rows"] == 9 and result["problems"] == []
    marker = json.loads((fp8 / "specshim_export.json").read_text())
    print("fp8 agreement the export reported", marker["agreement"])
    assert all(row["mean_cosine"] > 0.99 for row in marker["agreement"])
