"""``verify`` and ``status`` on what ``extract``'s pipeline wrote (with a
stand-in generator) and then was damaged: files of no sample, broken files
and a broken data_config.json are reported in one line, never a traceback
or a hang."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specshim.job.extract.command import extract

from ._pipeline_helpers import (
    _jsonl,
    _options,
    fake_fixture,  # noqa: F401 - the fixture `fake`
)


def test_verify_all_counts_files_of_no_sample_apart(tmp_path, tiny_model_dir, fake):
    from specshim.job.verify.command import verify_all

    model = tiny_model_dir("llama")
    rows = [{"input_ids": [i + 1, i + 2]} for i in range(5)]
    data, out = _jsonl(tmp_path / "d.jsonl", rows), tmp_path / "out"
    extract(_options(model, data, out))
    _jsonl(data, rows[:2])
    code, lines = verify_all(model, out, data)
    assert code == 1 and lines[-1] == "verify: FAILED"
    # The stand-in's states are 1 wide, so the two samples are bad: what
    # matters is that the three files of no sample are not taken from the good.
    assert lines[0].endswith("0 good, 2 bad or missing, 3 file(s) of no sample")
    assert sum(line.startswith("  ORPHAN") for line in lines) == 3


def _damage(out: Path) -> None:
    """What a hostile but fair user can leave in an output directory."""
    import os

    (out / "data_1.pt").write_text("not a sample\n")
    torch.save([[1, 2], [3]], out / "data_2.pt")  # a pickle of plain lists
    torch.save(
        {"input_ids": [1], "loss_mask": [1], "hidden_states": []}, out / "data_3.pt"
    )
    (out / "data_4.pt").unlink()
    os.mkfifo(out / "data_4.pt")  # opening it for reading would block forever
    os.mkfifo(out / ".specshim" / "manifest" / "stray.jsonl")


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specshim", *args],
        capture_output=True,
        text=True,
        timeout=timeout,  # a hang fails the test instead of stalling it
    )


def test_verify_and_status_report_damaged_files_and_never_hang(
    tmp_path, tiny_model_dir, fake
):
    model = tiny_model_dir("llama")
    rows = [{"input_ids": [i + 1, i + 2]} for i in range(6)]
    data, out = _jsonl(tmp_path / "d.jsonl", rows), tmp_path / "out"
    extract(_options(model, data, out))
    _damage(out)
    run = _cli(
        "verify", "--model", str(model), "--out", str(out), "--all", "--data", str(data)
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    bad = {
        line.split(":")[0].strip(): line
        for line in run.stdout.splitlines()
        if line.startswith("  BAD")
    }
    assert "not a speculators sample" in bad["BAD data_2.pt"]
    assert "not 1-D tensors" in bad["BAD data_3.pt"]
    assert "not a regular file" in bad["BAD data_4.pt"]
    assert "is not a torch file" in bad["BAD data_1.pt"]
    assert len(bad) == 6  # the stand-in's 1-wide states fail the rest: reported
    run = _cli("verify", "--model", str(model), "--out", str(out), "--samples", "6")
    assert "Traceback" not in run.stderr and run.returncode in (1, 2), run.stderr
    status = _cli("status", "--out", str(out))
    assert status.returncode == 1 and "Traceback" not in status.stderr
    assert "not proven by any manifest" in status.stdout


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"layers": [1]}, "max_model_len is None"),
        ({"layers": [1], "max_model_len": "2048"}, "max_model_len is '2048'"),
        ({"layers": "1", "max_model_len": 64}, "no list of layers"),
    ],
)
def test_a_damaged_data_config_is_one_line(
    tmp_path, tiny_model_dir, fake, config, message
):
    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2]}])
    out = tmp_path / "out"
    extract(_options(model, data, out))
    (out / "data_config.json").write_text(json.dumps(config))
    for extra in (["--all", "--data", str(data)], ["--samples", "1"]):
        run = _cli("verify", "--model", str(model), "--out", str(out), *extra)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 1 and len(lines) == 1, run.stderr[-2000:]
        assert message in lines[0]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"plain text, not a torch file\n", "is not a torch file"),
        (b"h\xe1\xa3\x19", "is not a torch file"),
        (b"", "is empty"),
        # What passes for a pickle's start reaches the unpickler, which reads
        # the rest as opcodes and fails in its own ways.
        (
            b"\x80\x02h\xe1\xa3\x19",
            "cannot be loaded safely (a damaged pickle: KeyError",
        ),
        (b"\x80\x02\x8a", "cannot be loaded safely (a damaged pickle: IndexError"),
        (b"\x80\x02X", "cannot be loaded safely (a damaged pickle: struct.error"),
        (b"\x80\x02U\xc8C\xd0a", "cannot be loaded safely ('utf-8' codec"),
        (b"PK\x03\x04", "cannot be loaded safely (PytorchStreamReader"),
    ],
    ids=[
        "text",
        "stray bytes",
        "empty",
        "KeyError",
        "IndexError",
        "struct.error",
        "UnicodeDecodeError",
        "zip header only",
    ],
)
def test_bytes_that_are_no_torch_file_are_a_bad_sample_not_a_traceback(
    tmp_path, content, why
):
    """verify reports one BAD line for each, saying why."""
    from specshim.job.verify.command import load_sample

    path = tmp_path / "data_0.pt"
    path.write_bytes(content)
    data, found = load_sample(path)
    assert data is None and found.startswith(why), found
