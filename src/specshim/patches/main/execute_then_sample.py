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
Upstream change:
    vLLM 0.12: ``Executor.sample_tokens``; ``execute_model`` may return None.
Upstream PR:
    vllm-project/vllm#26866 (async scheduling + structured outputs:
    ``sample_tokens``).
Remove when:
    speculators calls ``sample_tokens`` itself.
"""

from __future__ import annotations

from typing import Any

from specshim._types import NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import upstream, view_method


def execute_model(executor: Any, scheduler_output: Any, *args: Any, **kw: Any) -> Any:
    output = executor.execute_model(scheduler_output, *args, **kw)
    if output is None:
        output = executor.sample_tokens(None)
    return output


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
