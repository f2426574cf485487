"""How captured states are judged against the Hugging Face reference.

The bar itself lives in ``specshim.job.agreement`` (``specshim verify``
uses the same one); ``test_checks_reject_a_one_row_shift`` proves it catches a
shift of one row.
"""

from __future__ import annotations

from typing import Any

from specshim.job.agreement import mismatch

__all__ = ["assert_batch_matches", "mismatch"]


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
