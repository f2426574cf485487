"""Run in the newest speculators' environment (``make test-export``): read an
export with speculators' own ``ArrowDataset`` and check each row against the
extract it came from and against a Hugging Face forward, in that trainer's
convention. Prints one JSON line.

usage: read_with_speculators.py DEST SOURCE_OUT MODEL [fp8]

With ``fp8`` the rows are read through speculators' fp8 hidden-states backend
(``hs_connectors``' ``FP8Transfer``, what ``--hidden-states-backend fp8``
uses), and the states are compared with the source within the agreement bar
instead of bit for bit.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import torch
from speculators.train.data import ArrowDataset
from transformers import AutoModelForCausalLM

from specshim.job.verify.hf_reference import mismatch


def hf_states(model, ids: torch.Tensor, entering: list[int]) -> tuple[list, object]:
    """The state entering each decoder layer in ``entering`` (the convention
    speculators >= 0.5 names layers by) and the final layer's output before
    the norm, from hooks on HF's own modules."""
    layers = model.model.layers
    seen: dict[str, torch.Tensor] = {}

    def before(k):
        def hook(module, args, kwargs):
            seen[f"in{k}"] = (args[0] if args else kwargs["hidden_states"])[0]

        return hook

    def last(module, args, output):
        seen["last"] = (output[0] if isinstance(output, tuple) else output)[0]

    hooks = [
        layers[k].register_forward_pre_hook(before(k), with_kwargs=True)
        for k in entering
    ]
    hooks.append(layers[-1].register_forward_hook(last))
    with torch.no_grad():
        model(ids[None])
    for hook in hooks:
        hook.remove()
    return [seen[f"in{k}"] for k in entering], seen["last"]


def same_states(got: torch.Tensor, want: torch.Tensor, lossy: bool) -> bool:
    if not lossy:
        return torch.equal(got, want)
    return mismatch([got.float()], [want.float()]) is None


def main(dest: Path, out: Path, model_dir: Path, fp8: bool = False) -> dict:
    marker = json.loads((dest / "specshim_export.json").read_text())
    aux_ids = marker["layer_mapping"]["target_layer_ids"]
    transfer = None
    if fp8:
        from hs_connectors.transfer import FP8Transfer

        transfer = FP8Transfer(dest / "hidden_states")
    dataset = ArrowDataset(
        max_len=4096, datapath=str(dest), transfer=transfer, on_missing="raise"
    )
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    width = model.config.hidden_size
    problems = []
    for i in range(len(dataset)):
        item = dataset[i]
        if not isinstance(item, dict):
            problems.append(f"row {i}: {type(item).__name__}")
            continue
        source = torch.load(out / f"data_{i}.pt", weights_only=True)
        states = source["hidden_states"]
        same = {
            "input_ids": torch.equal(item["input_ids"], source["input_ids"].long()),
            "loss_mask": torch.equal(
                item["loss_mask"].long(), source["loss_mask"].long()
            ),
            "aux": same_states(
                item["hidden_states"], torch.cat(states[:-1], dim=-1), fp8
            ),
            "last": same_states(item["verifier_last_hidden_states"], states[-1], fp8),
        }
        problems += [
            f"row {i}: {k} differs from the source" for k, v in same.items() if not v
        ]
        entering, final = hf_states(model, item["input_ids"], aux_ids)
        aux = [
            item["hidden_states"][:, j * width : (j + 1) * width]
            for j in range(len(aux_ids))
        ]
        for j, layer in enumerate(aux_ids):
            why = mismatch([aux[j]], [entering[j]])
            if why:
                what = f"aux slot {j} is not the state entering layer {layer}"
                problems.append(f"row {i}: {what}: {why}")
        why = mismatch([item["verifier_last_hidden_states"]], [final])
        if why:
            problems.append(
                f"row {i}: the last slot is not the final layer's output: {why}"
            )
    return {
        "rows": len(dataset),
        "speculators": importlib.metadata.version("speculators"),
        "aux_ids": aux_ids,
        "problems": problems[:6],
        "problem_count": len(problems),
    }


if __name__ == "__main__":
    fp8 = sys.argv[4:] == ["fp8"]
    print("RESULT " + json.dumps(main(*map(Path, sys.argv[1:4]), fp8=fp8)))
