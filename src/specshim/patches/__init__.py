"""The patch set, one file per upstream change.

``main/`` holds patches to speculators' generator module (the process that builds
the scheduler); ``worker/`` holds patches to its worker extension (inside every
vLLM worker); ``deps/`` holds what speculators needs of its dependencies before
it can be imported (in every process). The order below is the apply order;
wrappers on the same target stack in this order. Removing a patch = deleting
its file and its line here.
"""

from __future__ import annotations

import importlib

DEPS = ("transformers_torch_annotation",)
MAIN = (
    "remote_code_gate",
    "remote_code_tokenizer",
    "close_at_exit",
    "scheduler_config_initvars",
    "chunked_prefill_off",
    "async_scheduling_off",
    "prefix_caching_off",
    "cpu_block_size",
    "cpu_mla_disable",
    "text_only_loading",
    "kv_cache_config_args",
    "cpu_kv_cache_space",
    "scheduler_block_size",
    "request_args",
    "finished_requests_delivered",
    "worker_start_method",
    "execute_then_sample",
    "rpc_unique_reply",
    "warm_up_after_init",
    "kv_cache_layout",
    "generate_guard",
)
WORKER = (
    "eagle3_gate",
    "capture_hooks",
    "row_provenance",
    "row_provenance_rpc",
    "state_transport",
    "state_order_rpc",
    "capture_contract",
)


# Rows of the drift table (docs/drift.md) that no patch answers, and why.
UNPATCHED_DRIFT = {
    23: "vLLM 0.17+: native hidden-state extraction (``extract_hidden_states``); "
    "another way to get the states, not a break.",
}


def load_all() -> None:
    """Import every patch file; each registers its patch on import."""
    for name in DEPS:
        importlib.import_module(f"specshim.patches.deps.{name}")
    for name in MAIN:
        importlib.import_module(f"specshim.patches.main.{name}")
    for name in WORKER:
        importlib.import_module(f"specshim.patches.worker.{name}")


# Importing any one patch file imports this package first: load the whole set
# here, so patches register (and stack) in the order above whatever is
# imported first.
load_all()
