"""The streaming pipeline of ``extract``, with a stand-in generator (the real
one runs in tests/e2e): records stream, writes overlap generation, and every
failure stops the run after writing what was already generated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from specshim._base import SpecShimError, UsageError
from specshim.job import extract as _extract
from specshim.job import feed as _feed
from specshim.job import status as _status
from specshim.job import store as _store
from specshim.job import writer as _writer
from specshim.job.dataset import RecordStream
from specshim.job.extract import ExtractOptions, extract


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


@pytest.fixture
def fake(monkeypatch):
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


def test_records_stream_lazily(tmp_path):
    rows = [{"input_ids": [i + 1]} for i in range(5)] + ["{broken"]
    stream = iter(RecordStream(_jsonl(tmp_path / "d.jsonl", rows)))
    # The first records come before the reader reaches the bad line 6.
    assert [next(stream).index for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(UsageError, match=r"d\.jsonl:6: not valid JSON"):
        next(stream)


def test_output_and_counts(tmp_path, tiny_model_dir, fake):
    model = tiny_model_dir("llama")
    rows = [{"input_ids": list(range(1, 2 + i % 7))} for i in range(11)]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    counts = extract(_options(model, data, out, shard=(1, 2)))
    assert counts["written"] == 5 and counts["dataset_samples"] == 11
    assert counts["shard_samples"] == 5 and counts["skipped"] == 0
    assert _written(out) == {i: rows[i]["input_ids"] for i in range(1, 11, 2)}
    assert fake[0].calls == 2  # batches of 4 and 1
    # The run recorded the dataset's size: status needs no --data to count.
    headers = [h for h, _ in _store.manifests(out)]
    assert headers[0]["dataset_samples"] == 11 and headers[0]["shard"] == [1, 2]
    half = _status.collect(out)
    assert (half.total, half.done, half.complete) == (11, 5, False)
    extract(_options(model, data, out, shard=(0, 2)))
    assert _status.collect(out).complete


def test_writes_overlap_the_next_generate(tmp_path, tiny_model_dir, fake, monkeypatch):
    """Batch 1's files are written only once batch 2 is generating."""
    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(8)])
    second_generate = threading.Event()
    save = _writer.prepare_sample

    def slow_save(run, todo, result):
        if todo.index == 0:
            assert second_generate.wait(60), "batch 2 never started while 1 wrote"
        return save(run, todo, result)

    def make(plan):
        fake.append(FakeGenerator(lambda n: n == 2 and second_generate.set()))
        return fake[-1]

    monkeypatch.setattr(_writer, "prepare_sample", slow_save)
    monkeypatch.setattr(_extract, "_make_generator", make)
    counts = extract(_options(model, data, tmp_path / "out"))
    assert counts["written"] == 8 and second_generate.is_set()


def test_a_bad_line_stops_the_run_after_what_was_generated(
    tmp_path, tiny_model_dir, fake
):
    model = tiny_model_dir("llama")
    rows: list[Any] = [{"input_ids": [i + 1]} for i in range(40)]
    rows[30] = {"input_ids": [1, 10**6]}  # line 31: outside the vocabulary
    data = _jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    with pytest.raises(UsageError, match=r"d\.jsonl:31: token id 1000000 is outside"):
        extract(_options(model, data, out))
    written = _written(out)
    # Every whole batch before the bad line (7 of 4), each the right sample:
    # samples still in the feed's unsent chunk count too.
    assert set(written) == set(range(28))
    assert written == {i: rows[i]["input_ids"] for i in written}
    assert not list(out.glob(".data_*"))
    # Fixed, a rerun writes the rest and nothing twice.
    rows[30] = {"input_ids": [7]}
    _jsonl(data, rows)
    counts = extract(_options(model, data, out))
    assert counts["skipped"] == len(written) and counts["written"] == 40 - len(written)


@pytest.mark.parametrize("writers", [1, 3], ids=["one-writer", "a-pool"])
def test_a_failing_writer_stops_the_run(
    tmp_path, tiny_model_dir, fake, monkeypatch, writers
):
    """One writer where vLLM computes on the CPU, a pool on a GPU host: either
    way, the samples before the failure are written and none after it."""
    monkeypatch.setattr(_writer, "writers", lambda: writers)
    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(40)])
    save = _writer.prepare_sample

    def failing_save(run, todo, result):
        if todo.index == 9:
            raise OSError(28, "No space left on device")
        return save(run, todo, result)

    monkeypatch.setattr(_writer, "prepare_sample", failing_save)
    out = tmp_path / "out"
    with pytest.raises(SpecShimError, match=r"writing data_9\.pt failed .*No space"):
        extract(_options(model, data, out))
    assert sorted(_written(out)) == list(range(9))
    # Samples 10 and 11 were serialized beside 9; nothing of them is left.
    assert not list(out.glob(".data_*"))
    # Batch 3 (samples 8-11) fails while batch 4 serializes beside it; one
    # batch waiting and one generating at most after those.
    assert fake[0].calls <= 6, "generation went on after the writer failed"


def test_the_feed_skips_what_out_holds_and_names_rewrites(
    tmp_path, tiny_model_dir, fake
):
    model = tiny_model_dir("llama")
    rows = [{"input_ids": [i + 1, i + 2]} for i in range(6)]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    extract(_options(model, data, out))
    rows[2] = {"input_ids": [50]}  # the record changed
    _jsonl(data, rows)
    (out / "data_4.pt").write_bytes(b"foreign")  # the file changed
    counts = extract(_options(model, data, out))
    assert counts["skipped"] == 4 and counts["written"] == 2
    assert len(fake) == 2
    # Nothing left to do: no model is loaded.
    assert extract(_options(model, data, out))["skipped"] == 6 and len(fake) == 2
    assert counts["rewritten"] == {_feed.CHANGED_SAMPLE: 1, _feed.CHANGED_FILE: 1}
    assert _written(out)[2] == [50]


def test_a_short_batch_from_the_generator_is_refused(
    tmp_path, tiny_model_dir, monkeypatch
):
    class Short(FakeGenerator):
        def generate(self, batch):
            return super().generate(batch)[:-1]

    monkeypatch.setattr(_extract, "_make_generator", lambda plan: Short())
    monkeypatch.setattr(_extract, "on_cpu", lambda: False)
    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(4)])
    with pytest.raises(SpecShimError, match="returned 3 results for 4 samples"):
        extract(_options(model, data, tmp_path / "out"))
    assert not _written(tmp_path / "out")


def _feed_spec(tmp_path: Path, model: Path) -> _feed.FeedSpec:
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [1]}])
    return _feed.FeedSpec(data, model, tmp_path, (0, 1), None, None, 320, 10, False)


def test_a_dead_feed_process_is_an_error(tmp_path, tiny_model_dir):
    feed = _feed.Feed(_feed_spec(tmp_path, tiny_model_dir("llama")))
    # Like the real feed, the process holds the pipe's write end until it dies
    # (without it the pipe ends at once, while the process is still starting).
    feed.process = type(feed.process)(
        target=_exit_hard, args=(feed._send,), daemon=True
    )
    feed.start()
    with pytest.raises(SpecShimError, match=r"specshim-feed\) died \(exit code 3\)"):
        list(feed)
    feed.close()


def test_a_feed_killed_halfway_through_a_message_is_an_error_not_a_hang(
    tmp_path, tiny_model_dir
):
    import os
    import signal
    import time

    feed = _feed.Feed(_feed_spec(tmp_path, tiny_model_dir("llama")))
    feed.process = type(feed.process)(
        target=_send_huge, args=(feed._send,), daemon=True
    )
    feed.start()
    time.sleep(1.0)  # it is blocked inside send(): the pipe holds 64 KiB
    os.kill(feed.process.pid, signal.SIGKILL)
    with pytest.raises(SpecShimError, match=r"died \(exit code -9\)"):
        list(feed)
    feed.close()


def test_a_feed_crash_is_one_line_and_its_traceback_a_file(tmp_path, tiny_model_dir):
    feed = _feed.Feed(_feed_spec(tmp_path, tiny_model_dir("llama")))
    trace = 'Traceback (most recent call last):\n  File "x.py"\nKeyError: 7\n'
    feed.items.put(("crash", trace))
    with pytest.raises(SpecShimError) as error:
        list(feed)
    message = str(error.value)
    assert "\n" not in message and "(KeyError: 7)" in message, message
    saved = tmp_path / ".specshim" / "feed-crash.txt"
    assert str(saved) in message and saved.read_text() == trace


def test_an_unexpected_generate_error_is_one_line(tmp_path, tiny_model_dir, fake):
    class Failing(FakeGenerator):
        def generate(self, batch):
            if batch[0][0] == 5:  # the second batch
                raise RuntimeError("CUDA error: an illegal memory access\nmore")
            return super().generate(batch)

    def make(plan):
        fake.append(Failing())
        return fake[-1]

    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(12)])
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_extract, "_make_generator", make)
        with pytest.raises(SpecShimError) as error:
            extract(_options(model, data, out))
    message = str(error.value)
    assert "\n" not in message and "RuntimeError: CUDA error" in message, message
    assert "samples 4 to 7" in message
    assert set(_written(out)) == {0, 1, 2, 3}  # the batch before it is written


def _exit_hard(out) -> None:
    import os

    os._exit(3)


def _send_huge(out) -> None:
    out.send(("chunk", [b"x" * (64 << 20)], 0, {}))


def test_shard_auto_from_slurm_and_kubernetes_covers_the_dataset(
    tmp_path, tiny_model_dir, fake, monkeypatch, capsys
):
    from specshim.cli import main

    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(7)])
    out = tmp_path / "out"
    command = ["extract", "--model", str(model), "--data", str(data)]
    command += ["--out", str(out), "--layers", "1", "--shard", "auto"]
    for name in ("SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    assert main(command) == 0
    assert sorted(_written(out)) == [1, 3, 5]
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")
    monkeypatch.setenv("SPECSHIM_SHARD_COUNT", "2")
    assert main(command) == 0
    assert sorted(_written(out)) == list(range(7))
    capsys.readouterr()
    assert main(["status", "--out", str(out)]) == 0
    assert "shard 0/2: 4 of 4 samples" in capsys.readouterr().out


def test_a_resumed_run_still_counts_the_samples_an_earlier_run_truncated(
    tmp_path, tiny_model_dir, fake, caplog
):
    model = tiny_model_dir("llama")
    long, short = list(range(1, 20)), [1, 2, 3]  # max_model_len 8: 7 tokens kept
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": i} for i in (long, short, long)])
    out = tmp_path / "out"
    extract(_options(model, data, out, max_model_len=8))
    caplog.clear()
    # The resumed run tokenizes only the new record; the two long samples it
    # skips were truncated by the first run and are in the output all the same.
    _jsonl(data, [{"input_ids": ids} for ids in (long, short, long, short)])
    with caplog.at_level("WARNING", logger="specshim"):
        counts = extract(_options(model, data, out, max_model_len=8))
    assert counts["skipped"] == 3 and counts["written"] == 1
    assert "2 of 4 samples are longer than max_model_len - 1 = 7" in caplog.text


def test_files_of_samples_a_shorter_dataset_lacks_are_never_counted_done(
    tmp_path, tiny_model_dir, fake
):
    """speculators' trainer reads every .pt in OUT: a rerun on a shorter
    dataset must not leave the old tail in place looking finished."""
    model = tiny_model_dir("llama")
    rows = [{"input_ids": [i + 1, i + 2]} for i in range(6)]
    data, out = _jsonl(tmp_path / "d.jsonl", rows), tmp_path / "out"
    extract(_options(model, data, out))
    _jsonl(data, rows[:4])
    with pytest.raises(UsageError, match=r"2 file\(s\) of samples .* --move-orphans"):
        extract(_options(model, data, out))
    assert sorted(_written(out)) == [0, 1, 2, 3, 4, 5]  # nothing removed unasked
    status = _status.collect(out)
    assert (status.total, status.done, status.orphans) == (4, 4, [4, 5])
    assert not status.complete
    assert "files of samples the dataset does not have" in "\n".join(
        _status.render(status, out)
    )
    extract(_options(model, data, out, move_orphans=True))
    assert sorted(_written(out)) == [0, 1, 2, 3]
    orphans = (out / ".specshim" / "orphans").rglob("*")
    moved = sorted(p.name for p in orphans if p.is_file())
    assert moved == ["data_4.pt.orphan", "data_5.pt.orphan"]
    # The trainer walks every folder and reads every name ending in pt: the
    # moved files were still among them (issue 48).
    from speculators.train.data import list_files

    assert sorted(p.name for p in list_files(out)) == [f"data_{i}.pt" for i in range(4)]
    assert _status.collect(out).complete


def test_verify_all_counts_files_of_no_sample_apart(tmp_path, tiny_model_dir, fake):
    from specshim.job.verify import verify_all

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


@pytest.mark.parametrize("before", [None, "7"])
def test_the_cpu_kv_cache_variable_is_set_for_the_generator_only(
    tmp_path, tiny_model_dir, fake, monkeypatch, before
):
    """On the CPU platform the job sizes vLLM's KV cache for the workers the
    generator starts; the process's environment is as it was afterwards."""
    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(3)])
    if before is None:
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", before)
    seen = []

    def make(plan):
        seen.append(os.environ.get("VLLM_CPU_KVCACHE_SPACE"))
        return FakeGenerator()

    monkeypatch.setattr(_extract, "_make_generator", make)
    monkeypatch.setattr(_extract, "on_cpu", lambda: True)
    extract(_options(model, data, tmp_path / "out", cpu_kv_space_gib=3))
    assert seen == ["3"]  # the flag wins over the variable, while it starts
    assert os.environ.get("VLLM_CPU_KVCACHE_SPACE") == before


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
    from specshim.job.verify import load_sample

    path = tmp_path / "data_0.pt"
    path.write_bytes(content)
    data, found = load_sample(path)
    assert data is None and found.startswith(why), found


def test_a_stalled_start_up_says_every_interval_what_it_waits_for(
    tmp_path, tiny_model_dir, fake, monkeypatch, caplog
):
    """While vLLM starts, extract logs the time so far and the phase, read
    from the main thread's stack (here a fake start-up that stalls in two of
    speculators' steps)."""
    import logging
    import time

    from specshim.job import startup

    monkeypatch.setattr(startup, "INTERVAL", 0.05)

    class Executor:
        def collective_rpc(self, method):  # noqa: ARG002 - read from the stack
            time.sleep(0.4)

    def wait_for_ready():
        time.sleep(0.4)

    def make(plan):
        wait_for_ready()
        Executor().collective_rpc("determine_available_memory")
        fake.append(FakeGenerator())
        return fake[-1]

    monkeypatch.setattr(_extract, "_make_generator", make)
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2]}])
    with caplog.at_level(logging.INFO, logger="specshim.job.extract"):
        extract(_options(tiny_model_dir("llama"), data, tmp_path / "out"))
    lines = [
        r.getMessage() for r in caplog.records if "still starting" in r.getMessage()
    ]
    loading = [x for x in lines if x.endswith("loading the weights")]
    profiling = [x for x in lines if x.endswith(": profiling memory")]
    assert (
        loading and profiling and lines.index(loading[-1]) < lines.index(profiling[0])
    )
    assert all("s so far)" in x for x in lines)
    count = len(lines)
    time.sleep(0.2)  # the watcher stopped with the start-up
    assert (
        len([r for r in caplog.records if "still starting" in r.getMessage()]) == count
    )


def test_the_run_says_where_its_time_went(
    tmp_path, tiny_model_dir, fake, monkeypatch, caplog
):
    """The closing profile line: a slow generate() shows as generate() time, a
    slow disk as the writer's serializing time and as batches waiting."""
    monkeypatch.setattr(_writer, "writers", lambda: 1)
    save = _writer.prepare_sample

    def slow_save(run, todo, result):
        time.sleep(0.03)
        return save(run, todo, result)

    monkeypatch.setattr(_writer, "prepare_sample", slow_save)
    monkeypatch.setattr(_extract, "_make_generator", lambda plan: _Slow())
    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(24)])
    with caplog.at_level("INFO", logger="specshim.job.extract"):
        counts = extract(_options(model, data, tmp_path / "out"))
    timing = counts["timing"]
    assert timing["generate"] >= 6 * 0.05  # 6 batches of 4, 50 ms each
    assert timing["writer_serializing"] >= 24 * 0.03 - 0.05  # one thread
    # One thread at 120 ms a batch against 50 ms of generate(): batches wait.
    assert timing["waiting_for_writer"] > 0.1
    assert timing["writer_idle"] < timing["writer_serializing"]
    line = [r.getMessage() for r in caplog.records if "after the first" in r.message]
    assert len(line) == 1 and "for its 1 threads' files" in line[0]


class _Slow(FakeGenerator):
    def generate(self, batch):
        time.sleep(0.05)
        return super().generate(batch)


def test_the_next_batch_serializes_while_one_commits(
    tmp_path, tiny_model_dir, fake, monkeypatch
):
    """The writer's pool is not idle while a batch's manifest lines are
    fsynced: batch 2's first file is serialized while batch 1 commits."""
    monkeypatch.setattr(_writer, "writers", lambda: 2)
    second_batch_saving = threading.Event()
    save, commit = _writer.prepare_sample, _writer.commit

    def slow_save(run, todo, result):
        if todo.index == 4:
            second_batch_saving.set()
        if todo.index == 3:  # batch 1 stays on the pool until batch 2 came
            time.sleep(0.5)
        return save(run, todo, result)

    def waiting_commit(run, prepared):
        if prepared and prepared[0].todo.index == 0:
            assert second_batch_saving.wait(10), "the pool idled during a commit"
        return commit(run, prepared)

    monkeypatch.setattr(_writer, "prepare_sample", slow_save)
    monkeypatch.setattr(_writer, "commit", waiting_commit)
    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(12)])
    counts = extract(_options(model, data, tmp_path / "out"))
    assert counts["written"] == 12 and second_batch_saving.is_set()
    assert sorted(_written(tmp_path / "out")) == list(range(12))


def test_the_rate_leaves_out_the_engines_shutdown(
    tmp_path, tiny_model_dir, fake, monkeypatch
):
    """Like start-up, closing vLLM (seconds on a GPU host) is not extraction:
    the rate counts from the first generate() to the last file committed."""
    monkeypatch.setattr(_extract, "_shutdown", lambda generator: time.sleep(1.0))
    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(8)])
    counts = extract(_options(model, data, tmp_path / "out"))
    assert counts["written"] == 8
    assert counts["seconds"] < 0.9, counts["seconds"]
