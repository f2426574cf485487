"""The feed of ``extract``'s pipeline, with a stand-in generator: records stream,
a bad line stops the run after what was generated, a rerun skips what OUT
holds, and a feed process that dies or crashes is one error, never a hang."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specshim._base import SpecShimError, UsageError
from specshim.job.extract import feed as _feed
from specshim.job.extract.command import extract
from specshim.job.inputs.dataset import RecordStream

from ._pipeline_helpers import (
    _jsonl,
    _options,
    _written,
    fake_fixture,  # noqa: F401 - the fixture `fake`
)


def test_records_stream_lazily(tmp_path):
    rows = [{"input_ids": [i + 1]} for i in range(5)] + ["{broken"]
    stream = iter(RecordStream(_jsonl(tmp_path / "d.jsonl", rows)))
    # The first records come before the reader reaches the bad line 6.
    assert [next(stream).index for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(UsageError, match=r"d\.jsonl:6: not valid JSON"):
        next(stream)


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


def _exit_hard(out) -> None:
    import os

    os._exit(3)


def _send_huge(out) -> None:
    out.send(("chunk", [b"x" * (64 << 20)], 0, {}))


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
