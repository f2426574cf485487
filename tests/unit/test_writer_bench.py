"""``make bench-writer`` times the files ``extract`` writes."""

from __future__ import annotations

import importlib
import json
import sys
import zipfile
from pathlib import Path

import pytest

from specshim.job.extract import command as _extract

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("writer_bench")
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop("writer_bench", None)


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
    writer_bench = bench
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
    written = tmp_path / "bench"
    writer_bench.write_with_writer(pairs, written)
    for todo, _ in pairs:
        name = f"data_{todo.index}.pt"
        assert _records(written / name) == _records(out / name), name


def test_brief_runs_the_plain_write_and_the_writer_only(bench, tmp_path, monkeypatch):
    """``--brief`` (a GPU run's tens of GB) writes the states twice, not five
    times: the plain write and the writer, no busy thread, no GIL shares."""
    argv = ["writer_bench.py", "--hidden", "64", "--layers", "2", "--samples", "4"]
    argv += ["--passes", "1", "--dir", str(tmp_path / "d")]
    argv += ["--results", str(tmp_path / "r"), "--brief"]
    monkeypatch.setattr(sys, "argv", argv)
    assert bench.main() == 0
    found = json.loads((tmp_path / "r" / "writer.json").read_text())["2 x 64"]
    assert found["plain"] > 0 and found["writer / plain"] > 0
    assert found["commit_syncs"] >= 1 and found["commit_seconds"] >= 0
    assert not [k for k in found if "busy" in k or "share" in k]


def test_the_record_names_the_hosts_page_cache_limits(bench, tmp_path):
    """A tens-of-GB write is read against the host's dirty-page limits: past
    them the kernel slows writers towards the disk's speed."""
    (tmp_path / "sys" / "vm").mkdir(parents=True)
    (tmp_path / "meminfo").write_text(
        "MemTotal:       134217728 kB\nMemAvailable:   104857600 kB\nDirty:  2048 kB\n"
    )
    for name, value in (("dirty_ratio", 20), ("dirty_background_ratio", 10)):
        (tmp_path / "sys" / "vm" / name).write_text(f"{value}\n")
    cache = bench.page_cache(tmp_path)
    assert cache["MemAvailable"] == 100 * 2**30 and cache["Dirty"] == 2 * 2**20
    assert "dirty_bytes" not in cache  # not shown: left out, not guessed
    # midpoint of 10% and 20% of 100 GiB
    assert bench.throttle_bytes(cache) == 15 * 2**30
    (tmp_path / "sys" / "vm" / "dirty_bytes").write_text("4294967296\n")
    assert bench.throttle_bytes(bench.page_cache(tmp_path)) == (2**32 + 10 * 2**30) // 2
    (tmp_path / "sys" / "vm" / "dirty_background_bytes").write_text("1073741824\n")
    assert bench.throttle_bytes(bench.page_cache(tmp_path)) == (2**32 + 2**30) // 2
    assert bench.throttle_bytes({}) is None
    found = {"state_bytes": 26 * 10**9, "page_cache": cache}
    assert "these states were over that" in bench._page_cache(found)
    assert bench._page_cache({"state_bytes": 1}) == ""
