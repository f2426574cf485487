"""``collective_rpc(..., unique_reply_rank=)`` returns a bare result.

Why:
    speculators reads the captured states with
    ``collective_rpc("_get_captured_states", unique_reply_rank=0)[0]``. vLLM's
    multiprocessing executor now returns the single reply itself rather than a
    one-item list, so ``[0]`` picks the first *layer's* tensor and speculators
    fails with "Boolean value of Tensor with more than one value is
    ambiguous" (or, for one captured layer, silently treats rows as layers).
    speculators' view of the executor wraps a unique reply back into a list.
    vLLM's own calls (``execute_model`` and friends) go to the real executor
    and keep the new behaviour.
Upstream change:
    vLLM 0.12: ``MultiprocExecutor.collective_rpc`` "Returns single result if
    unique_reply_rank ... is provided, otherwise list."
Upstream PR:
    not found (speculators' own 0.12 bump, vllm-project/speculators#225,
    names the change but no PR).
Remove when:
    speculators drops the ``[0]``.
"""

from __future__ import annotations

import inspect
from typing import Any

from specshim._types import Incompatible, NotNeeded
from specshim.patches._declare import declare
from specshim.patches._wrappers import upstream, view_method


def collective_rpc(executor: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
    result = executor.collective_rpc(method, *args, **kwargs)
    if kwargs.get("unique_reply_rank") is not None:
        return [result]
    return result


def _probe(original: Any) -> None:
    rpc = getattr(upstream(original), "collective_rpc", None)
    if rpc is None:
        raise Incompatible("MultiprocExecutor.collective_rpc", "no such method")
    if "unique_reply_rank" not in inspect.signature(rpc).parameters:
        raise Incompatible(
            "collective_rpc(..., unique_reply_rank=)", str(inspect.signature(rpc))
        )
    if "single result" not in (inspect.getdoc(rpc) or ""):
        raise NotNeeded("collective_rpc returns a list of replies")


PATCH = declare(
    __name__,
    __doc__,
    id="rpc-unique-reply",
    attribute="MultiprocExecutor",
    versions=">=0.12",
    probe=_probe,
    build=lambda original: view_method(original, "collective_rpc", collective_rpc),
    drift_rows=(8,),
)
