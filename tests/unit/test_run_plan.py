"""An extract run is planned once (``job/extract/plan.py``): the checkpoint is read
there and nowhere below it, refusals come before anything is created, and
what the generator is built with is the plan's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from specshim import _settings
from specshim._base import UsageError
from specshim.job.extract import command as _extract
from specshim.job.extract.options import ExtractOptions
from specshim.job.extract.plan import RunPlan, plan_run
from specshim.job.inputs import checkpoint

from ._pipeline_helpers import FakeGenerator


def _data(path: Path, count: int) -> Path:
    path.write_text(
        "".join(json.dumps({"input_ids": [1, 2, i + 3]}) + "\n" for i in range(count))
    )
    return path


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Any]:
    calls: list[Any] = []
    original = getattr(checkpoint, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(checkpoint, name, counted)
    return calls


def test_the_checkpoint_is_read_once_and_the_generator_gets_the_plan(
    tmp_path, tiny_model_dir, monkeypatch
):
    model = tiny_model_dir("llama")
    configs = _counting(monkeypatch, "text_config")
    fingerprints = _counting(monkeypatch, "model_fingerprint")
    plans: list[RunPlan] = []

    def make(plan: RunPlan) -> FakeGenerator:
        plans.append(plan)
        return FakeGenerator()

    monkeypatch.setattr(_extract, "_make_generator", make)
    monkeypatch.setattr(_extract, "on_cpu", lambda: False)
    options = ExtractOptions(
        model=model,
        data=_data(tmp_path / "d.jsonl", 3),
        out=tmp_path / "out",
        layers=[1],
        max_model_len=64,
        batch_size=2,
    )
    counts = _extract.extract(options)
    assert counts["written"] == 3
    assert (len(configs), len(fingerprints)) == (1, 1)
    (plan,) = plans
    assert plan.layers == (1,) and plan.max_len == 63 and plan.model.path == model
    assert plan.identity["model_fingerprint"] == plan.model.fingerprint
    written = json.loads((tmp_path / "out" / "data_config.json").read_text())
    assert written == plan.output_config
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layers = (2,)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layers": [99]}, r"--layers \[99\] out of range"),
        ({"max_model_len": 1}, "--max-model-len must be at least 2"),
        ({"max_model_len": 1 << 20}, "positions"),
        ({"data": Path("missing.jsonl")}, "--data missing.jsonl: no such file"),
    ],
)
def test_the_plan_refuses_before_anything_is_created(
    tmp_path, tiny_model_dir, change, message
):
    options = ExtractOptions(
        model=tiny_model_dir("llama"),
        data=_data(tmp_path / "d.jsonl", 1),
        out=tmp_path / "out",
    )
    with pytest.raises(UsageError, match=message):
        _extract.extract(dataclasses.replace(options, **change))
    assert not (tmp_path / "out").exists()


def test_a_plan_is_what_the_options_and_the_model_say(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    options = ExtractOptions(
        model=model,
        data=_data(tmp_path / "d.jsonl", 1),
        out=tmp_path / "out",
        shard=(1, 3),
        batch_size=5,
        progress=False,
    )
    with _settings.preserved():  # the plan puts the step budget in force
        plan = plan_run(options)
    facts = checkpoint.read_model(model)
    assert plan.model == facts
    assert list(plan.layers) == checkpoint.choose_layers(None, facts.num_layers)
    assert (plan.shard, plan.batch_size, plan.progress) == ((1, 3), 5, False)
    assert (plan.feed.vocab_size, plan.feed.max_len) == (facts.vocab_size, 2047)
    assert (plan.data, plan.out) == (options.data, options.out)
