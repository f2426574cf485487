"""bench-reuse's data sets share what they claim to, and bench-gpu's notes say
what --parts reuse and --worker-profile found."""

from __future__ import annotations


def test_the_data_sets_share_what_issue_47_names(bench):
    dataset = bench("reuse_bench").dataset
    system = dataset("system", 12, 320)
    assert all(s[:1024] == system[0][:1024] for s in system)
    assert all(128 <= len(s) - 1024 <= 1023 for s in system)
    assert len({tuple(s[1024:1040]) for s in system}) == 12  # tails differ
    responses = dataset("responses", 12, 320)
    for group in range(3):
        four = responses[4 * group : 4 * group + 4]
        assert all(s[:512] == four[0][:512] for s in four)
        assert all(128 <= len(s) - 512 <= 512 for s in four)
    assert responses[0][:512] != responses[4][:512]
    unshared = dataset("unshared", 12, 320)
    assert len({tuple(s[:16]) for s in unshared}) == 12  # not one block shared
    assert all(256 <= len(s) <= 1536 and max(s) < 320 for s in unshared)


def test_bench_gpu_says_what_reuse_gained_and_what_the_profile_counted(bench):
    """--parts reuse: each of issue 47's data sets' speedup against its goal
    in a note; --worker-profile: the forward steps the calls took and the
    tokens speculators' KV cache holds."""
    summary_module = bench("gpu_summary")
    reuse = {
        "system": {"speedup": 2.5, "goal": 1.6, "samples": 256, "identical": 3},
        "unshared": {"speedup": 0.9, "goal": 0.97, "samples": 256, "identical": 256},
    }
    profile = {"calls": 4, "wall_s": 0.5, "device_us": 400000, "steps": 16}
    profile["tokens_per_step"] = [7000, 8100, 6900, 6600]
    parts = {
        "prefill@default": {"seconds": 4.0, "passes": [4.0, 4.1], "settings": {}},
        "generate": {
            "seconds": 5.0,
            "worker_profile": profile,
            "kv_cache_tokens": 32768,
        },
        "reuse": reuse,
    }
    text = summary_module.render(
        {"llama-1b": summary_module.summarise("llama-1b", parts, 1_000_000)}
    )
    assert (
        "llama-1b: extract --reuse-prefixes over extract, samples/s: system 2.50x "
        "(goal 1.6x, met; 3 of 256 files bit-identical); unshared 0.90x (goal "
        "0.97x, missed; 256 of 256 files bit-identical)." in text
    )
    assert "16 forward steps, 8,100 tokens in the largest" in text
    assert "speculators' KV cache holds 32,768 tokens" in text


def test_the_benches_read_where_extracts_time_went_from_its_own_line(
    bench, caplog, monkeypatch
):
    """bench-gpu's extract part and bench-reuse's runs parse extract's closing
    timing line: the line as ``_Pipeline._counts`` logs it, not a copy."""
    import logging
    from types import SimpleNamespace

    from specshim.job.extract.command import _Pipeline

    writer = SimpleNamespace(written=3, tokens=30, idle=2.5, threads=8)
    writer.__dict__.update(serializing=0.25, committing=0.5, syncs=4)
    pipeline = SimpleNamespace(
        began=0.0,
        ended=10.0,
        first_generate=2.0,
        handing=0.25,
        handed=9.0,  # the writer finished 1.0 s after the last batch came
        calls=[2.25, 1.0, 1.5, 1.0, 0.75],  # 6.5 s in generate()
    )
    from specshim import _moved

    moved = {"slabs": 5, "queued_bytes": 2_500_000_000}  # what the run received
    monkeypatch.setattr(_moved, "_TALLY", moved)
    with caplog.at_level(logging.INFO, logger="specshim.job.extract.command"):
        _Pipeline._counts(pipeline, writer)
    timing = bench("plan").extract_timing(caplog.text)
    assert timing == {
        "total": 8.0,
        "generate": 6.5,
        "handing": 0.2,  # the line rounds to tenths
        "writer_idle": 2.5,
        "threads": 8.0,
        "writer_serializing": 0.2,
        "writer_committing": 0.5,
        "writer_syncs": 4.0,
        "generate_first": 2.25,
        "generate_median": 1.0,
        "generate_slowest": 2.25,
        "finishing": 1.0,
        "between_calls": 0.25,  # 8.0 - 6.5 - 0.25 - 1.0
        "slabs": 5.0,
        "queued_gb": 2.5,
    }
    assert bench("plan").extract_timing("extract: wrote 3 samples") is None
    where = bench("reuse_bench").where({"timing": timing})
    assert where.startswith("of extract's 8.0 s, generate() took 6.5 s")
    assert "committed 0.5 s in 4 fsyncs of the manifest and waited for" in where
    assert where.endswith(
        "a generate() call took 2.25 s first, 1.0 s at the median and 2.25 s "
        "at the slowest; after the last call the writer took 1.0 s to finish, "
        "and the time between calls came to 0.25 s; the states came through "
        "5 shared slabs and 2.5 GB through vLLM's queue"
    )
    caplog.clear()
    monkeypatch.setattr(_moved, "_TALLY", {"slabs": 0, "queued_bytes": 0})
    with caplog.at_level(logging.INFO, logger="specshim.job.extract.command"):
        _Pipeline._counts(pipeline, writer)  # the transport off: no such line
    assert "shared slabs" not in caplog.text


def test_profiled_extract_profiles_the_worker_over_the_calls_it_is_told(
    bench, monkeypatch, tmp_path
):
    """reuse_bench --worker-profile: calls 2 and 3 of extract's, and only
    they, run under the worker's profiler; their seconds and forward steps
    are counted."""
    import json
    from types import SimpleNamespace

    from specshim.job.extract import command

    class Executor:
        def __init__(self) -> None:
            self.worker = SimpleNamespace()
            self.profiling: list[bool] = []

        def collective_rpc(self, method):
            return [method(self.worker)]

        def execute_model(self, scheduler_output):
            return None

    executor = Executor()

    def generate(generator, batch, writer):  # one forward step of len(batch)
        executor.profiling.append(hasattr(executor.worker, "_specshim_profiler"))
        executor.execute_model(SimpleNamespace(total_num_scheduled_tokens=len(batch)))
        return []

    monkeypatch.setattr(command, "_generate", generate)
    bench("profiled_extract").install(2, 2, tmp_path / "worker.txt")
    generator = SimpleNamespace(executor=executor)
    for n in range(1, 5):
        command._generate(generator, [0] * n, None)
    assert executor.profiling == [False, True, True, False]
    line = (tmp_path / "worker.txt").read_text().splitlines()[0]
    found = json.loads(line.removeprefix("WORKER-PROFILE "))
    assert found["calls"] == [2, 3] and len(found["calls_s"]) == 2
    assert found["tokens_per_step"] == [2, 3]


def test_reuse_md_says_where_the_cache_stayed_off(bench):
    """A data set in which no two samples share a first block runs with the
    cache off; its row says so rather than show a cache that served 0%."""
    markdown = bench("reuse_bench").markdown
    row = {
        "samples": 4,
        "tokens": 4000,
        "samples_per_second": {"without": 2.0, "with": 2.0},
        "speedup": 1.0,
        "goal": 0.97,
        "met": True,
        "agreement": {"identical": 4},
    }
    results = {"model": "m", "machine": "h", "runs_a_side": 1, "datasets": {}}
    results["datasets"]["unshared"] = row | {"with": [{"cache_off": True}]}
    results["datasets"]["system"] = row | {"with": [{"served_tokens": 1000}]}
    lines = markdown(results).splitlines()
    assert lines[-2].startswith("| unshared | 4 | 4,000 | 0% (cache off) | 2.00 |")
    assert lines[-1].startswith("| system | 4 | 4,000 | 25% | 2.00 |")
