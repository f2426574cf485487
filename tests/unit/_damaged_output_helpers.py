"""What the tests of damaged output directories (issue 36) share: an output
written by the real store and writer, without a generator or a feed process
(so each test stays fast), and samples serialized as torch writes them."""

from __future__ import annotations

import io
import json
import time
from array import array
from pathlib import Path
from typing import Any

import torch

from specshim.job.extract.feed import Todo
from specshim.job.extract.writer import commit, prepare_sample
from specshim.job.inputs.checkpoint import hidden_size, model_fingerprint
from specshim.job.outdir import store as _store
from specshim.job.outdir.data_config import (
    output_config,
    run_identity,
)

LAYERS = [1, 3, 5]  # the tiny Llama has 6 decoder layers and 320 token ids
MAX_LEN = 64


def _states(ids: list[int], width: int) -> list[torch.Tensor]:
    """Layer k's state of token t: a function of (t, k), as a model's would be."""
    return [
        torch.stack([torch.full((width,), float(t + k)) for t in ids]) for k in LAYERS
    ]


def _fabricate(tmp_path: Path, model: Path, count: int) -> tuple[Path, Path]:
    """An output of ``count`` samples written as ``extract`` writes them, and
    its dataset. Sample i starts with token 300 + i (over 255: it does not fit
    a uint8)."""
    width = hidden_size(model)
    records = [{"input_ids": [300 + i, *range(1, 2 + i)]} for i in range(count)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    _store.prepare_out(out)
    run = _store.Run(out, {"shard": [0, 1]})
    identity = run_identity(model_fingerprint(model), LAYERS, MAX_LEN)
    run.publish_config(output_config(identity, model, 1))
    prepared = []
    for index, record in enumerate(records):
        ids, mask = record["input_ids"], [1] * len(record["input_ids"])
        todo = Todo(
            index,
            f"{data}:{index + 1}",
            _store.record_digest(record),
            _store.token_digest(ids, mask),
            array("i", ids),
            array("b", mask),
        )
        result = {"input_ids": torch.tensor(ids), "hidden_states": _states(ids, width)}
        prepared.append(prepare_sample(run, todo, result))
    commit(run, prepared)
    run.annotate({"dataset_samples": count, "finished": time.time()})
    run.close()
    return out, data


def _sample(ids: Any, width: int = 256, layers: int = len(LAYERS)) -> dict[str, Any]:
    ids = torch.as_tensor(ids)
    return {
        "input_ids": ids,
        "loss_mask": torch.ones(len(ids), dtype=torch.long),
        "hidden_states": [torch.zeros(len(ids), width) for _ in range(layers)],
    }


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
