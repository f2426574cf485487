"""The end-to-end reference cases on a GPU, for every model of the tier under
vLLM's own runner choice and with the V2 runner forced (see conftest.py).

The cases are ``tests/e2e/test_reference_match.py``'s own functions. Left
out: the two that change a live runner for the test (the V1 runner's batch
order, padding every forward), which vLLM's CUDA runners cannot take; the
V2 runner reorders rows by itself, and every case here must survive it."""

from __future__ import annotations

from ..e2e.test_reference_match import (  # noqa: F401 - collected here
    test_batch_over_token_budget,
    test_checks_reject_a_one_row_shift,
    test_duplicate_prompts,
    test_more_sequences_than_max_num_seqs,
    test_one_token_sequences,
    test_repeated_calls_with_different_batch_sizes,
    test_rows_dropped_or_repeated_in_the_worker_are_refused,
    test_rows_in_the_runners_order_leave_as_they_were_captured,
    test_shared_system_prompt,
    test_what_generate_returns_is_the_callers_alone,
    test_workers_free_every_finished_request,
)
