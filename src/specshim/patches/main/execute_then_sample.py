"""``execute_model`` must be followed by ``sample_tokens``.

Why:
    speculators calls ``executor.execute_model(scheduler_output)`` once per step
    and ignores the result. vLLM split a step in two: ``execute_model`` returns
    None and keeps the step's state in the workers until ``sample_tokens
    (grammar_output)`` is called. Without it the next step fails with "State
    error: sample_tokens() must be called after execute_model() returns None".
    speculators' view of the executor calls ``sample_tokens(None)`` (no
    structured output) whenever ``execute_model`` returns None. vLLM's own
    engine, which calls the executor directly, is untouched.

    speculators ignores the step's output, so the call does not wait for it
    where the executor can send it without waiting (``non_block``): the
    worker's sampling waits for the forward, and the main process meanwhile
    ends the step's requests and schedules the next step, which on a GPU
    otherwise idles between steps (a 1.2B Llama's H200 was busy for 69% of
    ``generate()``'s time). The reply is read before the next call's, in
    order (vLLM's executor drains its pending replies first), so a failed
    step still raises, at the latest when the states are fetched.
Upstream change:
    vLLM 0.12: ``Executor.sample_tokens``; ``execute_model`` may return None.
Upstream PR:
    vllm-project/vllm#26866 (async scheduling + structured outputs:
    ``sample_tokens``).
Remove when:
    speculators calls ``sample_tokens`` itself.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from specshim._types import NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import upstream, view_method


def execute_model(executor: Any, scheduler_output: Any, *args: Any, **kw: Any) -> Any:
    output = executor.execute_model(scheduler_output, *args, **kw)
    if output is None:
        if _sends_without_waiting(type(executor).sample_tokens):
            return executor.sample_tokens(None, non_block=True)
        output = executor.sample_tokens(None)
    return output


@functools.lru_cache(maxsize=8)
def _sends_without_waiting(sample_tokens: Any) -> bool:
    """Whether this executor's ``sample_tokens`` takes ``non_block``."""
    try:
        return "non_block" in inspect.signature(sample_tokens).parameters
    except (TypeError, ValueError):
        return False


def _probe(original: Any) -> None:
    if not hasattr(upstream(original), "sample_tokens"):
        raise NotNeeded("the executor has no sample_tokens step")


PATCH = declare(
    __name__,
    __doc__,
    id="execute-then-sample",
    attribute="MultiprocExecutor",
    versions=">=0.12",
    probe=_probe,
    build=lambda original: view_method(original, "execute_model", execute_model),
    drift_rows=(7,),
)
