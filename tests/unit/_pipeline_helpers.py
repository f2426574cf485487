"""What the tests of ``extract``'s streaming pipeline share: a stand-in
generator (the real one runs in tests/e2e), the fixture that installs it,
and small readers and writers of datasets and outputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from specshim.job.extract import command as _extract
from specshim.job.extract.command import ExtractOptions


class FakeGenerator:
    """Returns states that are a function of each token, like a real model."""

    def __init__(self, on_generate: Any = None) -> None:
        self.calls = 0
        self.on_generate = on_generate
        self.executor = self

    def generate(self, batch: list[list[int]]) -> list[dict[str, Any]]:
        self.calls += 1
        if self.on_generate is not None:
            self.on_generate(self.calls)
        return [
            {
                "input_ids": torch.tensor(ids),
                "hidden_states": [torch.tensor(ids, dtype=torch.float32)[:, None]],
            }
            for ids in batch
        ]

    def shutdown(self) -> None:
        pass


@pytest.fixture(name="fake")
def fake_fixture(monkeypatch):
    made: list[FakeGenerator] = []

    def make(plan, on_generate=None):
        made.append(FakeGenerator(on_generate))
        return made[-1]

    monkeypatch.setattr(_extract, "_make_generator", make)
    monkeypatch.setattr(_extract, "on_cpu", lambda: False)
    return made


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    )
    return path


def _options(model: Path, data: Path, out: Path, **kw: Any) -> ExtractOptions:
    return ExtractOptions(
        model=model, data=data, out=out, layers=[1], batch_size=4, **kw
    )


def _written(out: Path) -> dict[int, list[int]]:
    files = {int(p.stem.split("_")[1]): p for p in out.glob("data_*.pt")}
    return {
        i: torch.load(p, weights_only=True)["input_ids"].tolist()
        for i, p in files.items()
    }
