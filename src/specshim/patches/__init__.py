"""The patch set, one file per upstream change.

``main/`` holds patches to speculators' generator module (the process that builds
the scheduler); ``worker/`` holds patches to its worker extension (inside every
vLLM worker); ``deps/`` holds what speculators needs of its dependencies before
it can be imported (in every process). The order below is the apply order;
wrappers on the same target stack in this order. Each file declares its patch
(``PATCH``) and registers nothing: ``PATCHES`` is the set the registry is
handed (``specshim`` gives it the loader). Removing a patch = deleting its
file, its import and its entry below.

Rooms: ``deps/``, ``main/``, ``worker/`` (the patch files); ``_transport/``
(the hand-over of captured states, used by ``worker/state_transport`` and
``main/generate_guard``); ``_declare`` (how a file declares its patch);
``_wrappers`` (the wrappers and probes patches build from).
"""

from __future__ import annotations

# The patch files in apply order (not the alphabet):
# isort: off
from specshim.patches.deps import transformers_torch_annotation
from specshim.patches.main import remote_code_gate
from specshim.patches.main import remote_code_tokenizer
from specshim.patches.main import close_at_exit
from specshim.patches.main import scheduler_config_initvars
from specshim.patches.main import chunked_prefill_off
from specshim.patches.main import async_scheduling_off
from specshim.patches.main import prefix_caching_off
from specshim.patches.main import cpu_block_size
from specshim.patches.main import cpu_mla_disable
from specshim.patches.main import text_only_loading
from specshim.patches.main import kv_cache_config_args
from specshim.patches.main import cpu_kv_cache_space
from specshim.patches.main import scheduler_block_size
from specshim.patches.main import request_args
from specshim.patches.main import finished_requests_delivered
from specshim.patches.main import worker_start_method
from specshim.patches.main import execute_then_sample
from specshim.patches.main import rpc_unique_reply
from specshim.patches.main import warm_up_after_init
from specshim.patches.main import kv_cache_layout
from specshim.patches.main import generate_guard
from specshim.patches.worker import eagle3_gate
from specshim.patches.worker import capture_hooks
from specshim.patches.worker import row_provenance
from specshim.patches.worker import row_provenance_rpc
from specshim.patches.worker import state_transport
from specshim.patches.worker import state_order_rpc
from specshim.patches.worker import prepared_slabs
from specshim.patches.worker import capture_contract
from specshim.patches.worker import cpu_amx_tiles
# isort: on

DEPS = (transformers_torch_annotation,)
MAIN = (
    remote_code_gate,
    remote_code_tokenizer,
    close_at_exit,
    scheduler_config_initvars,
    chunked_prefill_off,
    async_scheduling_off,
    prefix_caching_off,
    cpu_block_size,
    cpu_mla_disable,
    text_only_loading,
    kv_cache_config_args,
    cpu_kv_cache_space,
    scheduler_block_size,
    request_args,
    finished_requests_delivered,
    worker_start_method,
    execute_then_sample,
    rpc_unique_reply,
    warm_up_after_init,
    kv_cache_layout,
    generate_guard,
)
WORKER = (
    eagle3_gate,
    capture_hooks,
    row_provenance,
    row_provenance_rpc,
    state_transport,
    state_order_rpc,
    prepared_slabs,
    capture_contract,
    cpu_amx_tiles,  # last: the outermost wrapper (capture-hooks calls no original)
)

# The patch set in apply order: what the registry's loader hands it.
PATCHES = tuple(module.PATCH for module in (*DEPS, *MAIN, *WORKER))


# Rows of the drift table (docs/drift.md) that no patch answers, and why.
UNPATCHED_DRIFT = {
    23: "vLLM 0.17+: native hidden-state extraction (``extract_hidden_states``); "
    "another way to get the states, not a break.",
}
