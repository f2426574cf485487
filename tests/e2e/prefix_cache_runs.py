"""What vLLM's prefix cache does to speculators' captured rows, in a process
of its own (``python -m tests.e2e.prefix_cache_runs MODEL_DIR``): the
generator with prefix caching on (``prefix-caching-off`` and the guard
turned off, a block hasher given to speculators' requests by hand: vLLM's
own behaviour, before the guard's reading of it), three calls whose
sequences share whole blocks, and per call the rows speculators returned,
the workers' provenance record and ``match_tails``' reading of it, as one
JSON line. Issue 47's proof rests on
what this shows; tests/e2e/test_prefix_cache_runs.py reads it."""

from __future__ import annotations

import importlib
import json
import os
import sys


def main(model: str) -> None:
    os.environ["SPECSHIM_DISABLE"] = "prefix-caching-off,generate-guard"
    import specshim  # noqa: F401  (the patches first)

    module = importlib.import_module(
        "speculators.data_generation.vllm_hidden_states_generator"
    )
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from specshim.job.extract.prefixes import engine_hash_fn
    from specshim.patches._transport.rows import match_tails

    generator = module.VllmHiddenStatesGenerator(
        model, layer_ids=[1, 2, 3], max_model_len=256, gpu_memory_utilization=0.5
    )
    block = generator.vllm_config.cache_config.block_size
    hasher = get_request_block_hasher(block, engine_hash_fn("sha256"))

    class HashedRequest(Request):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("block_hasher", hasher)
            super().__init__(*args, **kwargs)

    module.Request = HashedRequest
    shared = [10 + i for i in range(2 * block + block // 2)]  # 2.5 blocks
    first, second = shared + [5, 6, 7], shared + [8, 9]
    other = [100 + i for i in range(block + 1)]
    calls = [[first, other], [second, first], [second]]
    found = {
        "block": block,
        "caching": generator.vllm_config.cache_config.enable_prefix_caching,
        "calls": [],
    }
    for sequences in calls:
        results = generator.generate(sequences)
        (record,) = generator.executor.collective_rpc(
            "_specshim_row_provenance", unique_reply_rank=0
        )[:1]
        record = record[0] if isinstance(record, list) else record
        runs, strays, untold = match_tails(
            sequences, record["token_ids"], record["positions"], record["rows"], block
        )
        found["calls"].append(
            {
                "lengths": [len(s) for s in sequences],
                "returned": [int(r["hidden_states"][0].shape[0]) for r in results],
                "positions": record["positions"].tolist(),
                "runs": runs,
                "strays": strays,
                "untold": untold,
            }
        )
    from specshim import close

    close(generator)
    print("FOUND " + json.dumps(found), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
