"""``specshim extract --data-parallel N`` end to end on vLLM's CPU backend: the
same files as one run, each shard's part in ``status``, a shard killed mid-run.

``--batch-size 1`` in both runs compared: each sample is then generated alone in
either, so the files must be bit-identical (other batch-mates change the CPU
kernels' blocking, see test_shards_equal_one_unsharded_run)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specshim.job.outdir.store import manifests

from .test_extract import (
    _assert_visible_files_whole,
    _command,
    _dataset,
    _files,
    _run_ok,
    _start,
    _wait_for_files,
)

pytestmark = pytest.mark.e2e

ALONE = ("--batch-size", "1")


def _what_manifests_say(out: Path) -> dict[int, tuple]:
    """Each proven sample's manifest entry, less where the file lies on disk
    (inode, time; and size, which holds the temporary name's length)."""
    found = {}
    for _, entries in manifests(out):
        for e in entries:
            found[e.index] = (e.tokens, e.record, e.num_tokens, e.truncated)
    return found


def _assert_identical(whole: Path, other: Path) -> None:
    assert sorted(_files(whole)) == sorted(_files(other))
    for index, path in _files(whole).items():
        a = torch.load(path, weights_only=True)
        b = torch.load(other / path.name, weights_only=True)
        assert a.keys() == b.keys()
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        assert len(a["hidden_states"]) == len(b["hidden_states"])
        for x, y in zip(a["hidden_states"], b["hidden_states"], strict=True):
            assert torch.equal(x, y), f"data_{index}.pt differs"
    assert _what_manifests_say(whole) == _what_manifests_say(other)
    config = json.loads((whole / "data_config.json").read_text())
    assert json.loads((other / "data_config.json").read_text()) == config


def _status(out: Path, data: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "specshim", "status", "--out", str(out)]
    return subprocess.run(
        [*command, "--data", str(data)], capture_output=True, text=True, timeout=120
    )


def test_two_shards_write_what_one_run_writes(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    data = _dataset(tmp_path / "d.jsonl", 8, 5, 60, seed=7)
    whole, both = tmp_path / "whole", tmp_path / "both"
    _run_ok(_command(model, data, whole, *ALONE), timeout=600)
    run = _run_ok(_command(model, data, both, *ALONE, "--data-parallel", "2"))
    assert "wrote 8 samples (0 already there)" in run.stdout, run.stdout
    _assert_identical(whole, both)
    for index in range(2):
        log = both / ".specshim" / f"shard-{index}-of-2.log"
        assert f"--shard {index}/2" in log.read_text().splitlines()[0]
    status = _status(both, data)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "shard 0/2: 4 of 4 samples" in status.stdout
    assert "shard 1/2: 4 of 4 samples" in status.stdout
    for index in range(2):  # and which run wrote them
        assert re.search(
            rf"run \S+ \(ended, shard {index}/2\): 4 samples", status.stdout
        )
    again = _run_ok(_command(model, data, both, *ALONE, "--dp", "2"))
    assert "wrote 0 samples (8 already there)" in again.stdout, again.stdout


def _shard_process(parent: int, shard: str, limit: float = 120):
    """The child ``extract`` process of ``parent`` that runs ``--shard shard``."""
    import psutil

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for child in psutil.Process(parent).children():
            command = child.cmdline()
            if "--shard" in command and command[command.index("--shard") + 1] == shard:
                return child
        time.sleep(0.1)
    raise AssertionError(f"no child runs --shard {shard}")


# `extended` (make test-extended): make test runs the same children to the end
# in test_two_shards_write_what_one_run_writes.
@pytest.mark.extended
def test_a_killed_shard_stops_the_command_and_a_rerun_completes(
    tmp_path, tiny_model_dir
):
    model = tiny_model_dir("llama")
    data = _dataset(tmp_path / "d.jsonl", 40, 200, 700, seed=8)
    out, clean = tmp_path / "out", tmp_path / "clean"
    command = _command(model, data, out, *ALONE, "--data-parallel", "2")
    process = _start(command)
    victim = _shard_process(process.pid, "1/2")
    _wait_for_files(out, process, 4)
    victim.send_signal(signal.SIGKILL)
    output, _ = process.communicate(timeout=400)
    assert process.returncode == 1, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith(
        "specshim extract: error: shard 1/2 failed: killed by SIGKILL"
    ), last
    log = out / ".specshim" / "shard-1-of-2.log"
    assert str(log) in last and log.exists()
    assert "rerun the same command to resume" in last
    written = len(_files(out))
    assert written < 40, "the kill did not land mid-run"
    _assert_visible_files_whole(out)

    rerun = _run_ok(command)
    assert f"({written} already there)" in rerun.stdout, rerun.stdout
    assert not list(out.glob(".*.partial"))
    _run_ok(_command(model, data, clean, *ALONE), timeout=900)
    _assert_identical(clean, out)


@pytest.mark.extended
def test_ctrl_c_stops_every_shard(tmp_path, tiny_model_dir):
    import psutil

    model = tiny_model_dir("llama")
    data = _dataset(tmp_path / "d.jsonl", 40, 200, 700, seed=9)
    out = tmp_path / "out"
    process = _start(_command(model, data, out, *ALONE, "--dp", "2"))
    shards = [_shard_process(process.pid, f"{i}/2") for i in range(2)]
    _wait_for_files(out, process, 4)
    started = [p for s in shards for p in [s, *s.children(recursive=True)]]
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 130, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert "interrupted: every shard was stopped" in last, last
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, f"left running: {alive}"
    _assert_visible_files_whole(out)
    assert len(_files(out)) < 40
