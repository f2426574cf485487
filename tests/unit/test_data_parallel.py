"""``extract --data-parallel N``: its refusals, one line each before anything
starts, and how it splits the GPUs and the shards among its children."""

from __future__ import annotations

import sys

import pytest

from specshim._base import SpecShimError, UsageError
from specshim.cli import _extract_argv, build_parser, main
from specshim.job.extract import parallel
from specshim.job.extract.parallel import Slot, plan_slots, visible_gpus

BASE = ["extract", "--model", "/nowhere/model", "--data", "d.jsonl", "--out", "o"]


@pytest.fixture
def gpus(monkeypatch):
    """A host whose driver lists ``count`` GPUs."""

    def host(count: int | None) -> None:
        monkeypatch.setattr(parallel, "_nvidia_gpus", lambda: count)

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return host


def _refused(capsys, *extra: str) -> str:
    code = main([*BASE, *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("count", ["0", "-1"])
def test_fewer_than_one_run_is_refused(capsys, gpus, count):
    gpus(None)
    err = _refused(capsys, "--data-parallel", count)
    assert err == (f"specshim extract: error: --data-parallel {count}: give at least 1")


@pytest.mark.parametrize("flag", ["--data-parallel", "--dp"])
def test_more_gpus_than_visible_are_refused(capsys, gpus, flag):
    gpus(4)
    err = _refused(capsys, flag, "3", "--tp", "2")
    assert "--data-parallel 3 x --tp 2 needs 6 GPUs; 4 visible" in err


def test_cuda_visible_devices_bounds_what_is_visible(capsys, gpus, monkeypatch):
    gpus(8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    err = _refused(capsys, "--dp", "2", "--tp", "2")
    assert "needs 4 GPUs; 3 visible (CUDA_VISIBLE_DEVICES=4,5,6)" in err


def test_a_hand_made_shard_is_refused(capsys, gpus):
    gpus(None)
    err = _refused(capsys, "--dp", "2", "--shard", "1/4")
    assert "--data-parallel gives each of its runs a shard itself" in err
    assert "drop --shard 1/4" in err


def test_shard_auto_without_a_cluster_is_refused(capsys, gpus, monkeypatch):
    gpus(None)
    for name in ("SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(name, raising=False)
    assert "found no cluster task index" in _refused(
        capsys, "--dp", "2", "--shard", "auto"
    )


def test_each_run_sees_only_its_slice_of_the_visible_gpus(gpus, monkeypatch):
    gpus(8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3")
    visible = visible_gpus()
    assert visible == ["7", "6", "5", "4", "3"]
    assert plan_slots(2, 2, None, visible) == [
        Slot((0, 2), ("7", "6")),
        Slot((1, 2), ("5", "4")),
    ]


def test_cuda_visible_devices_is_read_as_cuda_reads_it(gpus, monkeypatch):
    gpus(4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2,-1,3")
    assert visible_gpus() == ["0", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus() == ["0", "1", "2", "3"]
    gpus(None)
    assert visible_gpus() is None  # no NVIDIA GPU: vLLM's CPU backend


def test_on_cpu_as_many_runs_as_cores_are_planned(monkeypatch):
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda _: set(range(6)))
    slots = plan_slots(3, 2, None, None)
    assert [s.shard for s in slots] == [(0, 3), (1, 3), (2, 3)]
    assert all(s.gpus is None for s in slots)


def test_shard_auto_splits_this_hosts_shard_among_its_runs():
    hosts, runs = 3, 2
    taken: list[int] = []
    for host in range(hosts):
        slots = plan_slots(runs, 1, (host, hosts), None)
        for slot in slots:
            index, count = slot.shard
            mine = [j for j in range(60) if j % count == index]
            assert all(j % hosts == host for j in mine)  # within this host's
            taken += mine
    assert sorted(taken) == list(range(60))  # every sample once


def test_children_get_the_same_arguments_less_dp_and_shard():
    argv = [
        "-v",
        *BASE,
        "--layers",
        "1,3",
        "--max-num-seqs",
        "4",
        "--trust-remote-code",
        "--dp",
        "2",
        "--shard",
        "auto",
    ]
    args = build_parser().parse_args(argv)
    child = build_parser().parse_args([*_extract_argv(args), "--shard", "0/2"])
    mine, theirs = dict(vars(args)), dict(vars(child))
    for name in ("data_parallel", "shard", "func"):
        mine.pop(name), theirs.pop(name)
    assert mine == theirs
    assert child.shard == "0/2" and child.data_parallel is None


def test_the_progress_line_has_the_pace_the_eta_and_each_shard(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(parallel.time, "time", lambda: 1000.0)
    children = [
        SimpleNamespace(
            slot=Slot((0, 2), None), state="running", samples=6, tokens=3000, first=990
        ),
        SimpleNamespace(
            slot=Slot((1, 2), None), state="starting", samples=0, tokens=0, first=None
        ),
    ]
    line = parallel.progress_line(children, left=66)
    # 3000 tokens in 10 s; 60 samples left at 0.6 samples/s: 100 s.
    assert line == (
        "extract: 6 samples, 300 tok/s, ETA 00:01:40; "
        "shards: 0/2 running 6, 1/2 starting 0"
    )
    assert "ETA ?" in parallel.progress_line(children, left=None)


def test_progress_counts_only_entries_as_a_run_writes_them():
    """A child's manifest is read with the manifest's own parser: a header, a
    torn or damaged line counts nothing and stops nothing (a token count that
    is no number used to raise in the parent's progress loop)."""
    import json

    child = parallel._Child(Slot((0, 2), None), process=None, log=None, started=0.0)
    entry = [3, "ab" * 8, "cd" * 8, 4096, 17, 1_000, 250, False]
    lines = [
        json.dumps({"run": "h-1-abc", "shard": [0, 2]}),
        json.dumps(entry),
        json.dumps([*entry[:6], "x", False]),  # a token count that is no count
        "{torn",
        "\xff\xfe not json",
    ]
    for line in lines:
        child._count(line.encode("utf-8", errors="surrogateescape"))
    assert (child.samples, child.tokens, child.state) == (1, 250, "running")


def test_a_shard_log_begins_with_the_gpus_it_was_given(tmp_path):
    """The log's first line is the child's command as a shell would run it:
    which GPUs a shard ran on is in its log; on CPU, no GPU but its share of
    the host's memory."""
    (tmp_path / ".specshim").mkdir()
    slots = [Slot((1, 2), ("2", "3")), Slot((0, 2), None)]
    argv = ["extract", "--model", "m", "--out", str(tmp_path)]
    for slot in slots:
        child = parallel._start(slot, [*argv, "--help"], tmp_path, runs=2)
        child.process.wait(timeout=120)
        child.log.close()
    first = [slot.log(tmp_path).read_text().splitlines()[0] for slot in slots]
    assert first[0].startswith("# CUDA_VISIBLE_DEVICES=2,3 ")
    assert first[0].endswith("--help --shard 1/2")
    assert first[1].startswith("# SPECSHIM_CPU_KV_SHARE=2 ")
    assert "CUDA_VISIBLE_DEVICES" not in first[1]
    # A rerun appends: the log a failure message named is still there.
    child = parallel._start(slots[0], [*argv, "--help"], tmp_path)
    child.process.wait(timeout=120)
    child.log.close()
    headers = [
        line
        for line in slots[0].log(tmp_path).read_text().splitlines()
        if line.startswith("# CUDA_VISIBLE_DEVICES=2,3 ")
    ]
    assert len(headers) == 2


def test_cpu_runs_of_one_command_share_the_kv_cache_cap(monkeypatch):
    """N runs on one CPU host start at once and each sees the same free
    memory: each may take 1/N of the half one run may take (N runs each
    taking half over-committed the host)."""
    from specshim.job import kv_cache

    gib = 1 << 30
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(kv_cache, "available_memory", lambda: 64 * gib)
    monkeypatch.delenv(kv_cache.SHARE, raising=False)
    assert kv_cache.cpu_kv_space(None, 100 * gib) == (32, "the job's need")
    monkeypatch.setenv(kv_cache.SHARE, "4")
    assert kv_cache.cpu_kv_space(None, 100 * gib) == (
        8,
        "the job's need, at most half the available memory over 4 runs",
    )
    assert kv_cache.cpu_kv_space(None, 2 * gib)[0] == 2  # under the cap
    assert kv_cache.cpu_kv_space(20, 100 * gib) == (20, "--cpu-kv-space-gib")
    for bad in ("two", "0", "-1"):
        monkeypatch.setenv(kv_cache.SHARE, bad)
        with pytest.raises(UsageError, match=f"SPECSHIM_CPU_KV_SHARE={bad}: give"):
            kv_cache.cpu_kv_space(None, 2 * gib)


def test_more_runs_than_the_cpu_host_has_cores_are_refused(capsys, monkeypatch):
    """--data-parallel 100000 started shards until it ran out of files, then
    ended in a traceback with 25 shards left running (issue 48)."""
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda _: {0, 1})
    monkeypatch.setattr(parallel, "visible_gpus", lambda: None)
    err = _refused(capsys, "--data-parallel", "100000")
    assert "needs 100000 CPU cores at least; this host lets the run use 2" in err


def test_more_runs_than_the_open_file_limit_allows_are_refused(monkeypatch):
    import resource

    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda _: set(range(64)))
    monkeypatch.setattr(resource, "getrlimit", lambda _: (32, 32))
    with pytest.raises(UsageError, match="needs about 104 open files; the limit is 32"):
        plan_slots(10, 1, None, None)


SLEEPER = ["run", "--", sys.executable, "-c", "import time; time.sleep(600)"]


def _gone(pid: int, within: float = 30.0) -> bool:
    import os
    import time

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie of ours counts as gone once reaped
        if os.waitpid(pid, os.WNOHANG)[0] if _is_child(pid) else False:
            return True
        time.sleep(0.1)
    return False


def _is_child(pid: int) -> bool:
    import os

    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    except OSError:
        return False


def test_no_shard_outlives_a_parent_killed_with_sigkill(tmp_path):
    import os
    import signal
    import subprocess

    (tmp_path / ".specshim").mkdir()
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path\n"
            "from specshim.job.extract import parallel\n"
            "from specshim.job.extract.parallel import Slot\n"
            f"argv = {SLEEPER!r}\n"
            "for i in range(2):\n"
            f"    out = Path({str(tmp_path)!r})\n"
            "    c = parallel._start(Slot((i, 2), None), argv, out)\n"
            "    print(c.process.pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    shards = [int(parent.stdout.readline()) for _ in range(2)]
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    alive = [pid for pid in shards if not _gone(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "shards outlived their parent"


def test_a_shard_that_cannot_start_stops_those_started(tmp_path, monkeypatch):
    started = []
    real = parallel._start

    def start(slot, argv, out, runs=1):
        if len(started) == 2:
            raise OSError(24, "Too many open files")
        started.append(real(slot, SLEEPER, out, runs))
        return started[-1]

    monkeypatch.setattr(parallel, "_start", start)
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2]}\n')
    slots = [Slot((i, 3), None) for i in range(3)]
    with pytest.raises(SpecShimError, match="shard 2/3 could not start: Too many"):
        parallel.run_parallel(slots, ["extract"], tmp_path / "out", data, {})
    assert [child.process.poll() for child in started] == [-9, -9]


def test_a_usage_error_only_a_shard_finds_is_a_usage_error(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2]}\n')
    argv = ["extract", "--model", str(tmp_path / "nope"), "--data", str(data)]
    argv += ["--out", str(tmp_path / "out")]
    slots = [Slot((i, 2), None) for i in range(2)]
    with pytest.raises(UsageError, match="shard ./2: --model .*nope"):
        parallel.run_parallel(slots, argv, tmp_path / "out", data, {})
