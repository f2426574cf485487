"""The captured states' slabs made while vLLM finishes starting, not on the
first calls' path.

Why:
    ``state-transport`` hands each call's states over in a slab of shared,
    pinned host memory, made when a call first needs it. Reserving and pinning
    one takes about 0.5 s a GB on an H200 host, and ``extract``, whose writer
    holds the calls it is still writing, needs four before any is free again:
    on a Kimi-width model (1.6 GB of states a call) the first calls carried
    seconds of it. Where the caller says how many rows its calls capture at
    most (``SPECSHIM_SLAB_ROWS``) and how many slabs it will hold
    (``SPECSHIM_SLABS``), tensor-parallel rank 0 starts making them on a
    thread of their own as soon as the capture is set up, beside the KV-cache
    allocation and the warm-up that follow; calls take them as they are made
    (``shared_states.HostRegion.prepare``). Which slab a call may write, and
    when, is unchanged.
Upstream change:
    None: part of specshim's state transport.
Upstream PR:
    none: not an upstream change.
Remove when:
    ``state-transport`` is removed.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from specshim._base import prepared_slabs
from specshim.patches._declare import declare
from specshim.patches._wrappers import require_callable

logger = logging.getLogger(__name__)


def prepare(extension: Any, layers: int) -> int:
    """Start making the slabs ``SPECSHIM_SLAB_ROWS`` and ``SPECSHIM_SLABS``
    ask for (on the rank that captures); how many were asked of the region."""
    wanted = prepared_slabs()
    if wanted is None or layers == 0:
        return 0
    from specshim.patches._transport.early_copies import stride_of
    from specshim.patches._transport.shared_states import region_of
    from specshim.patches.worker.capture_hooks import tp_rank

    if tp_rank() != 0:
        return 0
    import torch

    rows, count = wanted
    try:  # a row: the model's hidden size in its dtype (what the hooks capture)
        config = extension.model_config
        width = int(config.get_hidden_size())
        row_bytes = width * torch.empty((), dtype=config.dtype).itemsize
    except (AttributeError, TypeError, ValueError) as exc:  # the calls make them
        logger.debug("specshim: no slabs made ahead (the row size: %r)", exc)
        return 0
    nbytes = stride_of(rows, row_bytes) * layers
    device = getattr(extension, "device", None)
    on_gpu = isinstance(device, torch.device) and device.type == "cuda"
    made = region_of(extension).prepare(
        nbytes, count, torch.cuda.current_device() if on_gpu else None
    )
    if made:
        logger.info(
            "specshim: making %d slab(s) of %.0f MiB for the captured states of "
            "calls of up to %d rows, beside vLLM's start-up",
            made,
            nbytes / 2**20,
            rows,
        )
    return made


def _build(original: Any) -> Any:
    @functools.wraps(original)
    def setup_hidden_states_capture(self: Any, layer_ids: list[int]) -> None:
        original(self, layer_ids)
        prepare(self, len(layer_ids))

    setup_hidden_states_capture.__specshim__ = True  # type: ignore[attr-defined]
    return setup_hidden_states_capture


PATCH = declare(
    __name__,
    __doc__,
    id="prepared-slabs",
    attribute="HiddenStatesWorkerExtension._setup_hidden_states_capture",
    versions=">=0.11",
    probe=require_callable(
        "HiddenStatesWorkerExtension._setup_hidden_states_capture(layer_ids)"
    ),
    build=_build,
    requires=("state-transport",),  # its slabs are state-transport's
)
