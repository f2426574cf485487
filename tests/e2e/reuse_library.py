"""The library path of prefix reuse under eviction, in a process of its own
(``python -m tests.e2e.reuse_library MODEL_DIR OUT``): speculators' generator
with ``SPECSHIM_REUSE_PREFIXES=1`` and a KV cache of about 64 blocks, so one
long sequence evicts what the calls before it left cached. Six calls:

1. ``a`` (a prefix ``p`` of 2.5 blocks, then its own tail);
2. ``filler``, unrelated and long enough to take every block the cache has:
   ``p``'s blocks are evicted;
3. ``b`` (``p`` then another tail): vLLM computes it whole, so its rows are
   all computed, none served, though the store holds ``p``'s rows from ``a``;
4. ``c`` (``p`` then a third tail): served ``p``'s whole blocks from ``b``'s
   cache entries; its rows are put back from the store or, where the store
   holds nothing (``SPECSHIM_PREFIX_ROWS_MIB=0``), ``c`` is computed whole;
5. ``x`` (a block ``x`` and a few tokens): leaves ``x`` cached;
6. ``lent``: ``C`` (one block), ``X`` (``x`` then a tail ``t``) and ``S``
   (``C`` then ``t``). ``X``'s served tail follows on from ``C``'s rows in
   the forward, so the two read as one run with ``S``'s tokens, computed
   partly after ``x``: never taken for ``S``, which is computed whole.

Every call's rows go to OUT (torch.save), and one JSON line says what the
store served and recomputed after each call; tests/e2e/test_extract_reuse.py
checks both."""

from __future__ import annotations

import json
import os
import random
import sys

LAYERS = [1, 3, 5]
MAX_MODEL_LEN = 1024


def main(model: str, out: str) -> None:
    os.environ["SPECSHIM_REUSE_PREFIXES"] = "1"
    import specshim

    specshim.configure(cache_memory_fraction=float(os.environ["REUSE_KV_FRACTION"]))
    import torch
    from speculators.data_generation import VllmHiddenStatesGenerator

    from specshim._prefix_reuse import prefix_store

    generator = VllmHiddenStatesGenerator(
        model, layer_ids=LAYERS, max_model_len=MAX_MODEL_LEN
    )
    config = generator.vllm_config.cache_config
    block, blocks = config.block_size, config.num_gpu_blocks
    rng = random.Random(7)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(300) for _ in range(count)]

    p = tokens(2 * block + block // 2)
    # Every usable block (the pool keeps one aside as its null block).
    filler = tokens(min(MAX_MODEL_LEN - 1, (blocks - 1) * block - block // 2))
    x, cc, t = tokens(block), tokens(block), tokens(20)
    calls = {
        "a": [p + tokens(40)],
        "filler": [filler],
        "b": [p + tokens(33)],
        "c": [p + tokens(21)],
        "x": [x + tokens(5)],
        "lent": [cc, x + t, cc + t],
    }
    store = prefix_store(generator)
    found = {"block": block, "blocks": blocks, "caching": config.enable_prefix_caching}
    rows = {}
    for name, sequences in calls.items():
        results = generator.generate(sequences)
        rows[name] = [
            {"input_ids": ids, "hidden_states": [h.clone() for h in r["hidden_states"]]}
            for ids, r in zip(sequences, results, strict=True)
        ]
        found[name] = {
            "served": store.served_tokens,
            "recomputed": list(generator._specshim_recomputed),
        }
    specshim.close(generator)
    torch.save(rows, out)
    print("FOUND " + json.dumps(found), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
