"""``specshim extract`` judges what is in ``--out`` by content: an edited
dataset, a truncated file and a run that died early never leave a mixed or
locked directory; shards started at any moment share one directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from .test_extract import _command, _dataset, _files, _run_ok, _start

pytestmark = pytest.mark.e2e


def _verify_all(model: Path, out: Path, data: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "specshim", "verify", "--model", str(model)]
    cmd += ["--out", str(out), "--all", "--data", str(data)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _edit(data: Path, line: int) -> None:
    """Change sample ``line - 1`` of the dataset in place."""
    lines = data.read_text().splitlines()
    record = json.loads(lines[line - 1])
    if "input_ids" in record:
        record["input_ids"] = [(t + 1) % 300 for t in record["input_ids"]]
    elif "text" in record:
        record["text"] += " edited"
    else:
        record["messages"][0]["content"] += " edited"
    lines[line - 1] = json.dumps(record)
    data.write_text("\n".join(lines) + "\n")


def test_resume_judges_files_by_content(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    data = _dataset(tmp_path / "d.jsonl", 9, 5, 60)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    first = subprocess.run(
        _command(model, data, out), capture_output=True, text=True, env=env, timeout=600
    )
    assert first.returncode == 0, first.stderr[-3000:]
    # stdout is the command's result alone; vLLM's logs went to stderr.
    assert first.stdout.splitlines() == [first.stdout.strip()]
    assert first.stdout.startswith("extract: wrote 9 samples (0 already there)")
    assert "vLLM CPU KV-cache space 1 GiB (the job's need)" in first.stderr

    _edit(data, 2)  # sample 1 changes; its file stays
    _edit(data, 4)  # sample 3 changes, and its file is deleted
    (out / "data_3.pt").unlink()
    whole = (out / "data_5.pt").read_bytes()
    (out / "data_5.pt").write_bytes(whole[: len(whole) // 2])  # truncated
    again = _run_ok(_command(model, data, out))
    assert "wrote 3 samples, 2 of them rewritten (6 already there)" in again.stdout
    assert "the dataset's sample changed" in again.stderr
    assert "truncated, edited or foreign" in again.stderr
    for path in _files(out).values():
        torch.load(path, weights_only=True)
    checked = _verify_all(model, out, data)
    assert checked.returncode == 0 and "verify: ok" in checked.stdout, checked.stdout

    # Nothing left to do: no model is loaded.
    idle = _run_ok(_command(model, data, out))
    assert "wrote 0 samples (9 already there)" in idle.stdout
    assert "Initializing hidden states generator" not in idle.stderr

    # And verify --all names a file that went bad behind extract's back.
    _edit(data, 7)
    bad = _verify_all(model, out, data)
    assert bad.returncode == 1
    assert "BAD data_6.pt: holds other" in bad.stdout, bad.stdout

    # A planted pickle that would write a file if unpickled: every reader
    # refuses it without running it, and resume replaces it unread.
    marker = tmp_path / "pwned"
    (out / "data_0.pt").write_bytes(_malicious_pickle(marker))
    checked = _verify_all(model, out, data)
    assert checked.returncode == 1
    assert "BAD data_0.pt: cannot be loaded safely" in checked.stdout, checked.stdout
    hf = subprocess.run(
        [sys.executable, "-m", "specshim", "verify", "--model", str(model)]
        + ["--out", str(out), "--samples", "9"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert hf.returncode == 1 and "data_0.pt: cannot be loaded safely" in hf.stdout
    repaired = _run_ok(_command(model, data, out))
    assert "wrote 2 samples, 2 of them rewritten (7 already there)" in repaired.stdout
    assert _verify_all(model, out, data).returncode == 0
    assert not marker.exists(), "a planted pickle was executed"


def _malicious_pickle(marker: Path) -> bytes:
    import pickle

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (marker, "ran"))

    return pickle.dumps(Payload(), protocol=4)


def test_a_run_that_wrote_nothing_fixes_no_settings(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    data = _dataset(tmp_path / "d.jsonl", 3, 5, 30)
    out = tmp_path / "out"
    process = _start(_command(model, data, out))
    deadline = time.monotonic() + 60
    while not (out / ".specshim").exists():  # the run has started on --out
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    assert not (out / "data_config.json").exists()
    other = _command(model, data, out)
    other[other.index("--max-model-len") + 1] = "512"
    _run_ok(other)
    assert json.loads((out / "data_config.json").read_text())["max_model_len"] == 512


@pytest.mark.extended  # two shards at once: test_extract_parallel's, in CI
def test_three_shards_started_apart_share_one_directory(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    data = _dataset(tmp_path / "d.jsonl", 24, 20, 200, seed=5)
    out = tmp_path / "out"
    shards = []
    for index in range(3):
        if index:
            time.sleep(10)
        shards.append(_start(_command(model, data, out, "--shard", f"{index}/3")))
    for shard in shards:
        output, _ = shard.communicate(timeout=900)
        assert shard.returncode == 0, output[-3000:]
    assert sorted(_files(out)) == list(range(24))
    checked = _verify_all(model, out, data)
    assert checked.returncode == 0 and "verify: ok" in checked.stdout, checked.stdout
    assert not list(out.glob(".*.partial"))
    assert not list((out / ".specshim" / "runs").iterdir())
