"""``specshim status`` counts from stat results and manifests alone."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

from specshim.cli import main
from specshim.job.outdir import store as _store


def _write(out: Path, run: _store.Run, index: int, tokens: int) -> None:
    tmp = run.partial_path(f"data_{index}.pt")
    tmp.write_bytes(b"x" * (100 + index))
    stat = tmp.stat()
    entry = _store.Entry(
        index, "aa", _record(index), stat.st_size, stat.st_ino, stat.st_mtime_ns, tokens
    )
    run.record(entry)
    os.replace(tmp, _store.final_path(out, index))


def _record(index: int) -> str:
    """The record digest of ``_dataset``'s sample ``index`` (status compares
    it with the dataset's)."""
    from specshim.job.inputs.dataset import _normalise

    row = {"input_ids": [1] * (index + 1)}
    return _store.record_digest(_normalise(row, "test", None))


def _dataset(path: Path, count: int) -> Path:
    path.write_text(
        "".join(json.dumps({"input_ids": [1] * (i + 1)}) + "\n" for i in range(count))
    )
    return path


def test_status_counts_shards_and_refuses_to_call_a_partial_set_complete(
    tmp_path, capsys
):
    out = tmp_path / "out"
    _store.prepare_out(out)
    (out / "data_config.json").write_text(json.dumps({"layers": [1]}))
    shard0 = _store.Run(out, {"shard": [0, 2], "dataset_samples": 5})
    for index in (0, 2, 4):
        _write(out, shard0, index, tokens=10)
    shard0.close()
    shard1 = _store.Run(out, {"shard": [1, 2], "dataset_samples": 5})
    _write(out, shard1, 1, tokens=7)
    shard1.close()
    # A planted pickle: status never opens it, and counts it as unproven.
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (marker, "ran"))

    (out / "data_3.pt").write_bytes(pickle.dumps(Payload()))

    code = main(["status", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 1 and "status: INCOMPLETE" in text
    assert "4 of 5 samples done, 37 tokens" in text
    assert "not proven by any manifest (a rerun rewrites them): 1 (data_3.pt)" in text
    assert "shard 0/2: 3 of 3 samples" in text and "shard 1/2: 1 of 2 samples" in text
    assert not marker.exists()

    (out / "data_3.pt").unlink()
    code = main(
        ["status", "--out", str(out), "--data", str(_dataset(tmp_path / "d.jsonl", 5))]
    )
    text = capsys.readouterr().out
    assert code == 1 and "missing: 1 samples (data_3.pt)" in text

    last = _store.Run(out, {"shard": [1, 2], "dataset_samples": 5})
    _write(out, last, 3, tokens=4)
    last.close()
    code = main(["status", "--out", str(out), "--data", str(tmp_path / "d.jsonl")])
    text = capsys.readouterr().out
    assert code == 0 and "status: complete" in text and "5 of 5 samples done" in text


def test_status_of_a_directory_that_is_not_there(tmp_path, capsys):
    assert main(["status", "--out", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
