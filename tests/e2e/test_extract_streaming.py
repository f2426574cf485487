"""``specshim extract`` streams any common format to the files a non-streamed
run makes, and a writer that fails mid-run stops it without losing a file."""

from __future__ import annotations

import json
import random
import re
import time

import psutil
import pytest
import torch

from .conftest import close_generator, make_generator
from .test_extract import (
    LAYERS,
    _assert_complete,
    _assert_visible_files_whole,
    _command,
    _dataset,
    _files,
    _run_ok,
    _start,
    _wait_for_files,
)

pytestmark = pytest.mark.e2e

ROLES = {"user": "human", "assistant": "gpt"}


def _chats(count: int) -> list[list[dict[str, str]]]:
    rng = random.Random(5)
    chats = []
    for i in range(count):
        turns = []
        for _ in range(rng.randint(1, 3)):
            question = f"q{i} " * rng.randint(1, 30)
            answer = f"a{i} " * rng.randint(1, 40)
            turns.append({"role": "user", "content": question})
            turns.append({"role": "assistant", "content": answer})
        chats.append(turns)
    return chats


def _sharegpt(turns: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{"from": ROLES[t["role"]], "value": t["content"]} for t in turns]


def _not_streamed(model, chats, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Today's way, by hand: speculators tokenizes the whole dataset at once,
    then the generator runs batch after batch with extract's step budget."""
    import specshim
    from specshim._settings import STEP_DEFAULTS

    specshim.configure(**STEP_DEFAULTS)
    from speculators.data_generation import preprocessing
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    pattern = preprocessing._detect_assistant_pattern(tokenizer)
    tokens = preprocessing._preprocess_batch(
        {"conversations": chats}, tokenizer, 1023, pattern
    )
    generator = make_generator(str(model), tp=1, layer_ids=LAYERS)
    try:
        samples = []
        ids = [t.tolist() for t in tokens["input_ids"]]
        for start in range(0, len(ids), batch_size):
            samples += generator.generate(ids[start : start + batch_size])
    finally:
        close_generator(generator)
        specshim.configure(reset=True)
    for sample, mask in zip(samples, tokens["loss_mask"], strict=True):
        sample["loss_mask"] = mask
    return samples


CHATS = 10


@pytest.fixture(scope="module")
def not_streamed(tiny_model_dir):
    return _not_streamed(tiny_model_dir("llama"), _chats(CHATS), batch_size=4)


def _write_format(name: str, root) -> tuple[object, list[str]]:
    """The same chats as JSONL (OpenAI turns), Parquet (ShareGPT turns) or a
    saved ``datasets`` directory (a split and a column named by flags)."""
    import datasets

    chats = _chats(CHATS)
    if name == "jsonl":
        jsonl = root / "chats.jsonl"
        jsonl.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
        return jsonl, []
    if name == "parquet":
        parquet = root / "chats.parquet"
        datasets.Dataset.from_list(
            [{"conversations": _sharegpt(c)} for c in chats]
        ).to_parquet(str(parquet))
        return parquet, []
    saved = root / "saved"
    datasets.DatasetDict(
        train=datasets.Dataset.from_list([{"chat": _sharegpt(chats[0])}]),
        test=datasets.Dataset.from_list([{"chat": c} for c in chats]),
    ).save_to_disk(str(saved))
    return saved, ["--split", "test", "--column", "chat"]


# Parquet and saved datasets are `extended` (make test-extended): their readers
# are tested without vLLM in tests/unit/test_dataset_formats.py, and this file
# checks the streamed pipeline end to end on JSONL.
@pytest.mark.parametrize(
    "name",
    [
        "jsonl",
        pytest.param("parquet", marks=pytest.mark.extended),
        pytest.param("datasets", marks=pytest.mark.extended),
    ],
)
def test_every_format_streams_to_the_non_streamed_files(
    tmp_path, tiny_model_dir, not_streamed, name
):
    model = tiny_model_dir("llama")
    data, extra = _write_format(name, tmp_path)
    out = tmp_path / f"out-{name}"
    _run_ok(_command(model, data, out, *extra), timeout=600)
    files = _files(out)
    assert sorted(files) == list(range(CHATS)), name
    for index, path in files.items():
        got = torch.load(path, weights_only=True)
        want = not_streamed[index]
        where = f"{name}: data_{index}.pt"
        assert torch.equal(got["input_ids"], want["input_ids"].cpu()), where
        assert torch.equal(got["loss_mask"], want["loss_mask"].long()), where
        assert 0 < got["loss_mask"].sum() < len(got["loss_mask"]), where
        # The same batches, so the same numbers.
        for mine, theirs in zip(
            got["hidden_states"], want["hidden_states"], strict=True
        ):
            assert torch.equal(mine, theirs.cpu()), where


# `extended` (make test-extended): the pipeline's reaction to a failing writer
# is unit-tested with a stand-in generator (test_a_failing_writer_stops_the_run).
@pytest.mark.extended
def test_a_writer_that_fails_mid_run_stops_it_and_a_rerun_completes(
    tmp_path, tiny_model_dir, hf_reference
):
    """The writer is cut off from the disk: the main process (where it runs)
    may no longer write a file over 64 KiB, as on a full disk or quota."""
    model = tiny_model_dir("llama")
    data = _dataset(tmp_path / "d.jsonl", 60, 300, 900, seed=4)
    out = tmp_path / "out"
    process = _start(_command(model, data, out))
    _wait_for_files(out, process, 4)
    psutil.Process(process.pid).rlimit(psutil.RLIMIT_FSIZE, (1 << 16, 1 << 16))
    failed_at = time.monotonic()
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 1, output[-3000:]
    assert time.monotonic() - failed_at < 120, "the run did not stop promptly"
    # torch's zip writer words EFBIG its own way ("unexpected pos ...").
    assert re.search(r"error: writing data_\d+\.pt failed", output), output[-3000:]
    assert "rerun the same command to resume" in output
    first = _files(out)
    assert 4 <= len(first) < 60, "the failure did not land mid-run"
    _assert_visible_files_whole(out)
    assert not list(out.glob(".data_*")), "a partial file was left behind"

    rerun = _run_ok(_command(model, data, out))
    assert f"({len(first)} already there)" in rerun.stdout, rerun.stdout
    _assert_complete(out, data, hf_reference, model)
