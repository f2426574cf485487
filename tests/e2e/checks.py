"""How captured states are judged against the Hugging Face reference.

bfloat16 MoE routing flips a few near-tie tokens (single tokens at cosine ~0.9
were seen between vLLM and HF, and between HF-bf16 and HF-fp32), so a sequence
is judged by shape, mean per-token cosine and the share of tokens above a
threshold, never by its single worst token. Misplaced rows score near zero on
most tokens, and ``test_checks_reject_a_one_row_shift`` proves the bar catches a
shift of one row.
"""

from __future__ import annotations

from typing import Any

MEAN_COSINE = 0.98
TOKEN_COSINE = 0.95
SHARE_ABOVE = 0.9


def mismatch(captured: list[Any], expected: list[Any]) -> str | None:
    """None if the captured layers match the reference, else why not."""
    from specshim.testing.reference import per_token_cosine

    if len(captured) != len(expected):
        return f"{len(captured)} layers captured, {len(expected)} expected"
    for k, (got, want) in enumerate(zip(captured, expected, strict=True)):
        if tuple(got.shape) != tuple(want.shape):
            return f"layer #{k}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        cos = per_token_cosine(got, want)
        mean = cos.mean().item()
        share = (cos >= TOKEN_COSINE).float().mean().item()
        if mean < MEAN_COSINE or share < SHARE_ABOVE:
            return f"layer #{k}: mean cosine {mean:.4f}, share >= {TOKEN_COSINE}: {share:.2f}"
    return None


def assert_batch_matches(
    results: list[dict[str, Any]], batch: list[list[int]], reference: Any, layers: list[int]
) -> None:
    assert len(results) == len(batch)
    failures = []
    for index, (ids, result) in enumerate(zip(batch, results, strict=True)):
        assert result["input_ids"].tolist() == list(ids), f"sequence {index}: input_ids"
        why = mismatch(result["hidden_states"], reference.states(list(ids), layers))
        if why:
            failures.append(f"sequence {index} (len {len(ids)}): {why}")
    assert not failures, "\n".join(failures[:10])
