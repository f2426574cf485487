"""``specshim extract`` end to end: training files speculators' own dataset code
reads, kill -9 and resume, shards, and a worker that dies mid-run."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specshim.job.verify.hf_reference import mismatch

pytestmark = pytest.mark.e2e

LAYERS = [1, 3, 5]


def _dataset(path: Path, count: int, low: int, high: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        kind = i % 3
        if kind == 0:
            ids = [rng.randrange(300) for _ in range(rng.randint(low, high))]
            lines.append({"input_ids": ids})
        elif kind == 1:
            lines.append(
                {"text": " ".join(str(rng.random()) for _ in range(rng.randint(1, 12)))}
            )
        else:
            lines.append(
                {
                    "messages": [
                        {"role": "user", "content": f"q{i} " * rng.randint(1, 9)},
                        {"role": "assistant", "content": f"a{i} " * 5},
                    ]
                }
            )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _command(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "specshim",
        "extract",
        "--model",
        str(model),
        "--data",
        str(data),
        "--out",
        str(out),
        "--layers",
        ",".join(map(str, LAYERS)),
        "--max-model-len",
        "1024",
        "--batch-size",
        "4",
        *extra,
    ]


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_for_files(
    out: Path, process: subprocess.Popen, count: int, limit: float = 300
) -> None:
    deadline = time.monotonic() + limit
    while len(list(out.glob("data_*.pt"))) < count:
        assert process.poll() is None, process.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no output in time"
        time.sleep(0.05)


def _files(out: Path) -> dict[int, Path]:
    return {int(p.stem.split("_")[1]): p for p in out.glob("data_*.pt")}


def _run_ok(cmd: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    # torch_file proved its layout against this torch's own torch.save (the
    # matrix runs this on every release's torch).
    assert "every file with torch.save" not in run.stderr, run.stderr[-3000:]
    return run


def _stamps(out: Path) -> dict[int, tuple[int, int]]:
    return {i: (p.stat().st_ino, p.stat().st_mtime_ns) for i, p in _files(out).items()}


def _assert_visible_files_whole(out: Path) -> None:
    """After a crash, every file under its final name loads completely."""
    for path in _files(out).values():
        torch.load(path, weights_only=True)


def _assert_complete(
    out: Path, data: Path, hf_reference, model: Path, check: int = 6
) -> None:
    total = sum(1 for line in data.read_text().splitlines() if line.strip())
    files = _files(out)
    assert sorted(files) == list(range(total))
    # Nothing else the trainer would pick up (its rule: the name ends in "pt").
    stray = [
        p
        for p in out.rglob("*")
        if p.name.endswith("pt")
        and p.parent == out
        and p.name not in {f"data_{i}.pt" for i in range(total)}
    ]
    assert not stray
    reference = hf_reference(model)
    for index in sorted(files)[:: max(1, total // check)]:
        sample = torch.load(files[index], weights_only=True)
        assert sample["loss_mask"].shape == sample["input_ids"].shape
        why = mismatch(
            sample["hidden_states"],
            reference.states(sample["input_ids"].tolist(), LAYERS),
        )
        assert why is None, f"data_{index}.pt: {why}"


def test_output_loads_with_speculators_training_dataset(
    tmp_path, tiny_model_dir, hf_reference
):
    model = tiny_model_dir("llama")
    data = _dataset(tmp_path / "d.jsonl", 9, 5, 60)
    out = tmp_path / "out"
    _run_ok(_command(model, data, out), timeout=600)
    _assert_complete(out, data, hf_reference, model, check=9)
    config = json.loads((out / "data_config.json").read_text())
    assert config["layers"] == LAYERS and len(config["model_fingerprint"]) == 32
    assert config["versions"]["speculators"] == "0.3.0"

    from speculators.train.data import Eagle3SampleFileDataset

    dataset = Eagle3SampleFileDataset(max_len=1024, datapath=str(out))
    assert len(dataset) == 9
    item = dataset[0]
    assert item["hidden_states"].shape[-1] == 2 * 256  # the two aux layers
    assert item["verifier_last_hidden_states"].shape[-1] == 256
    plain = torch.load(out / "data_0.pt", weights_only=True)
    assert plain["loss_mask"].sum().item() == len(plain["input_ids"])  # input_ids line
    chat = torch.load(out / "data_2.pt", weights_only=True)
    assert 0 < chat["loss_mask"].sum().item() < len(chat["input_ids"])  # assistant only

    verify = [
        sys.executable,
        "-m",
        "specshim",
        "verify",
        "--model",
        str(model),
        "--out",
        str(out),
        "--samples",
        "9",
    ]
    good = _run_ok(verify, timeout=600)
    assert "verify: ok" in good.stdout, good.stdout

    again = _run_ok(_command(model, data, out), timeout=600)
    assert "wrote 0 samples (9 already there)" in again.stdout

    # verify catches rows that are off by one.
    shifted = torch.load(out / "data_3.pt", weights_only=True)
    shifted["hidden_states"] = [h.roll(1, dims=0) for h in shifted["hidden_states"]]
    torch.save(shifted, out / "data_3.pt")
    # ... and states right in direction but scaled by 0.4.
    scaled = torch.load(out / "data_4.pt", weights_only=True)
    scaled["hidden_states"] = [h * 0.4 for h in scaled["hidden_states"]]
    torch.save(scaled, out / "data_4.pt")
    bad = subprocess.run(verify, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1 and "MISMATCH data_3.pt" in bad.stdout, bad.stdout
    assert re.search(r"MISMATCH data_4\.pt: .*mean norm ratio 0\.(39|40)\d", bad.stdout)


def test_kill_9_mid_run_then_resume_writes_each_sample_once(
    tmp_path, tiny_model_dir, hf_reference
):
    model = tiny_model_dir("llama")
    data = _dataset(tmp_path / "d.jsonl", 120, 300, 900, seed=1)
    out = tmp_path / "out"
    process = _start(_command(model, data, out))
    _wait_for_files(out, process, 6)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    first = _stamps(out)
    assert 6 <= len(first) < 120, "the kill did not land mid-run"
    _assert_visible_files_whole(out)

    rerun = _run_ok(_command(model, data, out))
    assert f"({len(first)} already there)" in rerun.stdout
    after = _stamps(out)
    assert all(after[i] == first[i] for i in first), "a finished sample was rewritten"
    assert not list(out.glob(".data_*"))
    _assert_complete(out, data, hf_reference, model)


# `extended` (make test-extended): make test checks sharded output against the
# dataset and the reference in test_three_shards_started_apart_share_one_directory.
@pytest.mark.extended
def test_shards_equal_one_unsharded_run(tmp_path, tiny_model_dir):
    model = tiny_model_dir("qwen2")
    data = _dataset(tmp_path / "d.jsonl", 11, 5, 200, seed=2)
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    runs = [_command(model, data, whole)] + [
        _command(model, data, sharded, "--shard", f"{i}/2") for i in range(2)
    ]
    for cmd in runs:
        _run_ok(cmd, timeout=600)
    assert sorted(_files(whole)) == sorted(_files(sharded)) == list(range(11))
    for index, path in _files(whole).items():
        a = torch.load(path, weights_only=True)
        b = torch.load(sharded / path.name, weights_only=True)
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        for x, y in zip(a["hidden_states"], b["hidden_states"], strict=True):
            # Other batch-mates change bf16 kernel blocking, not the values' meaning.
            cos = torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1)
            assert cos.min().item() > 0.999, f"data_{index}.pt differs between runs"


def test_dead_worker_ends_the_run_clearly_and_resume_completes(
    tmp_path, tiny_model_dir, hf_reference
):
    import psutil

    model = tiny_model_dir("llama")
    data = _dataset(tmp_path / "d.jsonl", 120, 300, 900, seed=3)
    out = tmp_path / "out"
    process = _start(_command(model, data, out))
    _wait_for_files(out, process, 4)
    workers = [
        p
        for p in psutil.Process(process.pid).children(recursive=True)
        if "Worker" in " ".join(p.cmdline()) + p.name()
    ]
    assert workers, "no vLLM worker process found"
    killed_at = time.monotonic()
    workers[0].kill()
    output, _ = process.communicate(timeout=120)
    assert time.monotonic() - killed_at < 60, "extract did not exit within a minute"
    assert process.returncode not in (0, None)
    assert "worker process died" in output
    assert "rerun the same command to resume" in output
    _assert_visible_files_whole(out)
    assert len(_files(out)) < 120

    _run_ok(_command(model, data, out))
    _assert_complete(out, data, hf_reference, model)


def test_a_worker_that_fails_to_start_is_one_line(tmp_path, tiny_model_dir):
    """vLLM's CPU worker cannot bind its threads to a core the host lacks."""
    data = _dataset(tmp_path / "d.jsonl", 3, 5, 20)
    cmd = _command(tiny_model_dir("llama"), data, tmp_path / "out")
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="999")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 1, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("specshim extract: error: the generator could not start")
    # vLLM logs the worker's traceback; none escapes specshim's main process.
    assert not any(
        line.startswith("Traceback (most recent call last)")
        for line in run.stderr.splitlines()
    )
    assert not list((tmp_path / "out").glob("data_*.pt"))
