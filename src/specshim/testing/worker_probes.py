"""Functions tests send to vLLM workers with ``executor.collective_rpc(fn)``.

They live in the installed package so that spawned workers can import them.
"""

from __future__ import annotations

from typing import Any


def tower_parameter_count(worker: Any) -> int:
    """Parameters of a multimodal model's encoder towers in this worker."""
    model = worker.model_runner.model
    names = getattr(model, "_tower_model_names", None) or ()
    return sum(
        param.numel()
        for name, param in model.named_parameters()
        if name.split(".", 1)[0] in names
    )
