"""Record which request owns which captured rows, in every worker.

Why:
    speculators slices captured rows into sequences by input position. The
    scheduler does not keep input order: without chunked prefill, a request
    that does not fit the step's token budget is skipped and later, smaller
    requests are scheduled ahead of it (vLLM 0.11 already does this; a batch
    over ``max(8192, max_model_len)`` tokens comes back silently misaligned on
    the very vLLM speculators 0.3.0 was written for). This patch wraps the
    capture setup (speculators' own or ``capture-hooks``') so that the worker's
    model runner logs, for every executed step, the requests in the order their
    tokens were laid out. ``captured-layout-rpc`` hands the log to
    ``generate-guard``, which re-slices rows by request or refuses to return
    them.
Upstream change:
    None by itself: vLLM's v1 scheduler (0.11 and later) skips requests that do
    not fit the token budget and schedules later ones first.
Remove when:
    speculators slices captured rows by request id instead of by position.
"""

from __future__ import annotations

import functools
from typing import Any

from specshim._registry import Incompatible, Patch, register
from specshim.patches._util import WORKER


def _record_layout(extension: Any, runner: Any) -> None:
    """Wrap this worker's ``model_runner.execute_model`` to log the row layout."""
    if getattr(runner, "_specshim_layout_wrapped", False):
        return
    execute_model = runner.execute_model

    def recording_execute_model(
        scheduler_output: Any, *args: Any, **kwargs: Any
    ) -> Any:
        output = execute_model(scheduler_output, *args, **kwargs)
        counts = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        batch = getattr(runner, "input_batch", None)
        order = list(getattr(batch, "req_ids", counts.keys()))
        extension._specshim_layout.extend(
            (rid, int(counts[rid])) for rid in order if rid in counts
        )
        return output

    runner.execute_model = recording_execute_model
    runner._specshim_layout_wrapped = True


def _build(original: Any) -> Any:
    @functools.wraps(original)
    def setup_hidden_states_capture(self: Any, layer_ids: list[int]) -> None:
        original(self, layer_ids)
        if not hasattr(self, "_specshim_layout"):
            self._specshim_layout = []
        _record_layout(self, self.model_runner)

    setup_hidden_states_capture.__specshim__ = True  # type: ignore[attr-defined]
    return setup_hidden_states_capture


def _probe(original: Any) -> None:
    if original is None or not callable(original):
        raise Incompatible(
            "HiddenStatesWorkerExtension._setup_hidden_states_capture(layer_ids)",
            repr(original),
        )


PATCH = register(
    Patch(
        id="row-layout",
        process="worker",
        module=WORKER,
        attribute="HiddenStatesWorkerExtension._setup_hidden_states_capture",
        package="vllm",
        versions=">=0.11",
        probe=_probe,
        build=_build,
        why=__doc__ or "",
        upstream="none: the v1 scheduler reorders requests over the token budget",
        remove_when="speculators slices rows by request id",
    )
)
