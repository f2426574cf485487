"""How captured states are judged against the Hugging Face reference.

The bar itself lives in ``specshim.job.verify.hf_reference`` (``specshim verify``
uses the same one); ``test_checks_reject_a_one_row_shift`` proves it catches a
shift of one row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from specshim.job.verify.hf_reference import mismatch

__all__ = ["assert_batch_matches", "found_by", "mismatch"]


def found_by(module: str, *args: str, **env: str) -> dict[str, Any]:
    """Run a scripted generator (``python -m module args``, specshim on, the
    variables ``env`` added) and return what its last ``FOUND {json}`` line
    says; the run must exit 0."""
    environ = {k: v for k, v in os.environ.items() if k != "SPECSHIM_DISABLE"}
    run = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=environ | env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = [x for x in run.stdout.splitlines() if x.startswith("FOUND ")][-1]
    return json.loads(line[6:])


def assert_batch_matches(
    results: list[dict[str, Any]],
    batch: list[list[int]],
    reference: Any,
    layers: list[int],
) -> None:
    assert len(results) == len(batch)
    failures = []
    for index, (ids, result) in enumerate(zip(batch, results, strict=True)):
        assert result["input_ids"].tolist() == list(ids), f"sequence {index}: input_ids"
        why = mismatch(result["hidden_states"], reference.states(list(ids), layers))
        if why:
            failures.append(f"sequence {index} (len {len(ids)}): {why}")
    assert not failures, "\n".join(failures[:10])


def assert_same_files(a: dict[int, Any], b: dict[int, Any], count: int) -> None:
    """Two extract outputs (``{index: path}``) hold the same samples, their
    tokens, loss masks and every layer's states bit for bit (whole-file bytes
    differ in the archive's folder name, which torch.save takes from the
    temporary file's name)."""
    import torch

    assert sorted(a) == sorted(b) == list(range(count))
    for index, path in a.items():
        x = torch.load(path, weights_only=True)
        y = torch.load(b[index], weights_only=True)
        assert x.keys() == y.keys()
        for key in ("input_ids", "loss_mask"):
            assert torch.equal(x[key], y[key]), f"data_{index}.pt: {key}"
        for p, q in zip(x["hidden_states"], y["hidden_states"], strict=True):
            assert p.dtype == q.dtype and p.shape == q.shape
            assert torch.equal(p.view(torch.uint8), q.view(torch.uint8)), index
