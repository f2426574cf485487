"""Every finished request reaches the workers, so that they free its state.

Why:
    Workers learn that a request is over only from the next step's
    ``scheduler_output.finished_req_ids``. speculators aborts each step's
    requests after the step and loops ``while schedule()`` has tokens to run:
    the last ``schedule()`` of every ``generate()`` call, which carries the
    ids of the last step's requests, has none, so it never reaches the
    workers. Those requests stay in the workers for good. vLLM's V2 GPU model
    runner keeps requests in a fixed pool of ``max_num_seqs`` slots: after a
    few calls a worker dies with ``AssertionError: No free indices``
    (``vllm/v1/worker/gpu/states.py``) and the next call's rows are
    misaligned. The V1 runner keeps each one's cached state (its token ids)
    for the life of the worker. speculators' view of the scheduler hands the
    ids of such an output back to the scheduler, so the next step that
    reaches the workers (the next ``generate()`` call's first) carries them,
    before it adds its own requests. vLLM's engine, which steps once more
    while ``has_finished_requests()``, delivers them the same way.
Upstream change:
    None by itself: speculators never delivered the last step's finished ids.
    It became fatal with vLLM's V2 GPU model runner (0.22; default for Llama
    and Qwen3 on 0.24, for every model from 0.29), whose request slots are a
    fixed pool.
Upstream PR:
    none: not an upstream change.
Remove when:
    speculators hands its last scheduler output to the executor, or builds on
    vLLM's engine.
"""

from __future__ import annotations

from typing import Any

from specshim._base import SpecShimError
from specshim._types import Incompatible
from specshim.patches._declare import declare
from specshim.patches._wrappers import view_method

_OUTPUT = "vllm.v1.core.sched.output"


def schedule(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """``Scheduler.schedule``, keeping finished ids that no step would deliver."""
    output = scheduler.schedule(*args, **kwargs)
    finished = output.finished_req_ids
    if finished and not output.total_num_scheduled_tokens:
        pending = getattr(scheduler, "finished_req_ids", None)
        if not isinstance(pending, set):
            raise SpecShimError(
                "the scheduler has no finished_req_ids set to keep "
                f"{len(finished)} finished request(s) in: the workers would "
                "never free them (finished-requests-delivered)"
            )
        pending.update(finished)
    return output


def _probe(original: Any) -> None:
    import importlib

    output = getattr(importlib.import_module(_OUTPUT), "SchedulerOutput", None)
    fields = set(getattr(output, "__dataclass_fields__", ()))
    for name in ("finished_req_ids", "total_num_scheduled_tokens"):
        if name not in fields:
            raise Incompatible(f"SchedulerOutput.{name}", f"fields {sorted(fields)}")


PATCH = declare(
    __name__,
    __doc__,
    id="finished-requests-delivered",
    attribute="Scheduler",
    versions=">=0.11",
    probe=_probe,
    build=lambda original: view_method(original, "schedule", schedule),
    drift_rows=(28,),
)
