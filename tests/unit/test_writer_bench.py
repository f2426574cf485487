"""``make bench-writer`` times the files ``extract`` writes, and its
``torch_file`` experiment writes ``torch.save``'s bytes exactly."""

from __future__ import annotations

import importlib
import io
import json
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specshim.job import extract as _extract

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield (
            importlib.import_module("writer_bench"),
            importlib.import_module("torch_file"),
        )
    finally:
        sys.path.remove(str(BENCHMARKS))
        for name in ("writer_bench", "torch_file"):
            sys.modules.pop(name, None)


def _records(path: Path) -> list[tuple[str, bytes]]:
    """Each record of a torch.save archive, less the archive's folder (named
    after the temporary file, so after the run that wrote it)."""
    with zipfile.ZipFile(path) as archive:
        return [
            (info.filename.split("/", 1)[1], archive.read(info))
            for info in archive.infolist()
        ]


class _Replay:
    """A generator that returns the bench's states for the ids it is given."""

    def __init__(self, pairs):
        self.by_ids = {tuple(r["input_ids"].tolist()): r for _, r in pairs}
        self.executor = self

    def generate(self, batch):
        return [self.by_ids[tuple(ids)] for ids in batch]

    def shutdown(self):
        pass


def test_the_bench_writes_the_files_extract_writes(
    bench, tmp_path, tiny_model_dir, monkeypatch
):
    writer_bench, torch_file = bench
    pairs = writer_bench.samples(5, hidden=16, layers=3, vocab=320, lengths=(3, 40))
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"input_ids": list(t.input_ids)}) + "\n" for t, _ in pairs)
    )
    monkeypatch.setattr(_extract, "_make_generator", lambda plan: _Replay(pairs))
    monkeypatch.setattr(_extract, "on_cpu", lambda: False)
    out = tmp_path / "extract"
    _extract.extract(
        _extract.ExtractOptions(
            model=tiny_model_dir("llama"),
            data=data,
            out=out,
            layers=[1, 2, 3],
            batch_size=2,
        )
    )
    for label, save in (("writer", None), ("torch_file", torch_file.save)):
        written = tmp_path / label
        writer_bench.write_with_writer(pairs, written, save=save)
        for todo, _ in pairs:
            name = f"data_{todo.index}.pt"
            assert _records(written / name) == _records(out / name), (label, name)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tokens=st.integers(1, 300),
    hidden=st.integers(1, 96),
    layers=st.integers(1, 6),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    name=st.from_regex(r"[a-z_0-9]{1,12}(\.[a-z0-9-]{1,9}){0,3}", fullmatch=True)
    | st.from_regex(r"\.[a-z_0-9]{1,12}(\.[a-z0-9-]{1,9}){1,3}", fullmatch=True),
)
def test_torch_file_writes_torch_saves_bytes(
    bench, tmp_path_factory, tokens, hidden, layers, dtype, name
):
    _, torch_file = bench
    where = tmp_path_factory.mktemp("f")
    data = {
        "input_ids": torch.arange(tokens),
        "hidden_states": [torch.randn(tokens, hidden).to(dtype) for _ in range(layers)],
        "loss_mask": torch.ones(tokens, dtype=torch.long),
    }
    torch.save(data, where / name)
    expected = (where / name).read_bytes()
    (where / name).unlink()
    torch_file.save(data, where / name)
    assert (where / name).read_bytes() == expected
    assert not torch_file._FALLBACK


def test_torch_file_leaves_what_it_cannot_prove_to_torch_save(bench, tmp_path):
    """A view of a larger storage: torch.save writes the whole storage; so
    does torch_file (its records come from torch's own _save)."""
    _, torch_file = bench
    base = torch.randn(10, 4)
    data = {"hidden_states": [base[2:5]]}
    torch_file.save(data, tmp_path / "v.pt")
    reference = io.BytesIO()
    torch.save(data, reference)
    loaded = torch.load(tmp_path / "v.pt", weights_only=True)
    assert torch.equal(loaded["hidden_states"][0], base[2:5])
    assert loaded["hidden_states"][0].untyped_storage().nbytes() == 160
