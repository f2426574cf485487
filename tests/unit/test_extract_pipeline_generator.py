"""The generator as ``extract``'s pipeline drives it, here a stand-in: its
start-up (logged while it stalls, the CPU KV cache set for it alone) and
its failures (a short batch, an unexpected error), each one line."""

from __future__ import annotations

import os

import pytest

from specshim._base import SpecShimError
from specshim.job.extract import command as _extract
from specshim.job.extract.command import extract

from ._pipeline_helpers import (
    FakeGenerator,
    _jsonl,
    _options,
    _written,
    fake_fixture,  # noqa: F401 - the fixture `fake`
)


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


def test_a_stalled_start_up_says_every_interval_what_it_waits_for(
    tmp_path, tiny_model_dir, fake, monkeypatch, caplog
):
    """While vLLM starts, extract logs the time so far and the phase, read
    from the main thread's stack (here a fake start-up that stalls in two of
    speculators' steps)."""
    import logging
    import time

    from specshim.job.extract import startup

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
    with caplog.at_level(logging.INFO, logger="specshim.job.extract.command"):
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


def test_a_failed_batch_names_its_samples_as_they_are():
    """A range only where the indexes run without a gap: a resumed run skips
    samples, and --reuse-prefixes reorders the feed ("21 to 4" said nothing)."""
    from types import SimpleNamespace

    def batch(*indexes):
        return [SimpleNamespace(index=i) for i in indexes]

    assert _extract._spelled(batch(4, 5, 6)) == "4 to 6"
    assert _extract._spelled(batch(21, 3, 4)) == "21, 3, 4"
    assert _extract._spelled(batch(3, 5, 6)) == "3, 5, 6"
    assert _extract._spelled(batch(*range(40, 0, -2))) == (
        "40, 38, 36, 34, 32, 30, 28, 26, 24, 22 ... (20 in all)"
    )
