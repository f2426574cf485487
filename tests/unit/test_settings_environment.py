"""The SPECSHIM_* environment: applied when speculators is imported later, a
wrong value reported where it is used (the generator, extract, doctor) and
never at import, and extract's step budget: its defaults, the environment and
flags in precedence. configure() itself is in test_settings_configure.py."""

from __future__ import annotations

import json

import pytest

import specshim
from specshim._base import GENERATOR, SpecShimError

from ._settings_helpers import (
    _fresh_python,
    _generator_module,  # noqa: F401 - the generator_module fixture
)


def test_environment_applies_when_speculators_is_imported_later():
    code = (
        "import json, sys, specshim\n"
        f"assert {GENERATOR!r} not in sys.modules\n"
        f"import {GENERATOR} as g\n"
        "specshim.configure(cache_memory_fraction=0.3)\n"
        "print(json.dumps([g.MAX_NUM_SEQS, g.MIN_MAX_BATCHED_TOKENS,"
        " g.CACHE_MEMORY_FRACTION,"
        " specshim.settings()['max_num_seqs']['source']]))\n"
    )
    done = _fresh_python(
        code,
        SPECSHIM_MAX_NUM_SEQS="128",
        SPECSHIM_MAX_BATCHED_TOKENS="32768",
        SPECSHIM_CACHE_MEMORY_FRACTION="0.9",
    )
    assert done.returncode == 0, done.stderr
    values = json.loads(done.stdout.strip().splitlines()[-1])
    # configure() wins over the environment; the rest come from it.
    assert values == [128, 32768, 0.3, "env SPECSHIM_MAX_NUM_SEQS"]


def test_bad_environment_value_never_breaks_import_or_version():
    # Every command, `--version` included, starts by importing specshim; a bad
    # value is reported where it is used, not here.
    bad = {"SPECSHIM_CACHE_MEMORY_FRACTION": "2", "SPECSHIM_MAX_NUM_SEQS": "abc"}
    done = _fresh_python(
        "import specshim; print(specshim.settings()['max_num_seqs']['error'])", **bad
    )
    assert done.returncode == 0, done.stderr
    assert "SPECSHIM_MAX_NUM_SEQS: max_num_seqs must be an integer" in done.stdout
    version = _fresh_python("from specshim.cli import main; main(['--version'])", **bad)
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("specshim ")


def test_bad_environment_value_refuses_the_generator_naming_it(
    generator_module, monkeypatch, tmp_path
):
    from specshim import _settings

    monkeypatch.setenv("SPECSHIM_MAX_NUM_SEQS", "abc")
    _settings.load_environment()  # what ``import specshim`` does
    state = specshim.settings()["max_num_seqs"]
    assert state["value"] is None and "SPECSHIM_MAX_NUM_SEQS" in state["error"]
    # Never speculators' own 32 in place of the budget the user asked for.
    with pytest.raises(SpecShimError, match=r"SPECSHIM_MAX_NUM_SEQS.*'abc'"):
        generator_module.VllmHiddenStatesGenerator(str(tmp_path))
    # An explicit value overrides the bad variable, without an error.
    assert specshim.configure(max_num_seqs=5)["max_num_seqs"]["value"] == 5
    _settings.require_valid_environment()
    assert generator_module.MAX_NUM_SEQS == 5


def test_bad_environment_value_is_a_one_line_usage_error_of_extract(
    tiny_model_dir, monkeypatch, tmp_path, capsys
):
    from specshim.cli import main

    monkeypatch.setenv("SPECSHIM_CACHE_MEMORY_FRACTION", "2")
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2]}\n')
    model = str(tiny_model_dir("llama"))
    code = main(["extract", "--model", model, "--data", str(data), "--out", "o"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("specshim extract: error: environment ")
    assert "SPECSHIM_CACHE_MEMORY_FRACTION" in lines[0]


def test_doctor_reports_a_bad_environment_value(generator_module, monkeypatch, capsys):
    from specshim import _settings
    from specshim.cli import main

    monkeypatch.setenv("SPECSHIM_MAX_BATCHED_TOKENS", "-1")
    _settings.load_environment()
    code = main(["doctor"])
    out = capsys.readouterr().out
    assert code == 1
    assert "SPECSHIM_MAX_BATCHED_TOKENS: max_batched_tokens must be >= 1" in out


def test_extract_step_budget_precedence(generator_module, monkeypatch, tmp_path):
    from specshim._settings import STEP_DEFAULTS
    from specshim.job.extract.options import ExtractOptions
    from specshim.job.extract.plan import step_settings

    options = ExtractOptions(model=tmp_path, data=tmp_path, out=tmp_path)
    state = step_settings(options)  # no flags, no environment: extract's defaults
    assert {k: v["value"] for k, v in state.items()} == STEP_DEFAULTS
    assert {v["source"] for v in state.values()} == {"extract default"}
    assert generator_module.MAX_NUM_SEQS == STEP_DEFAULTS["max_num_seqs"]

    # The environment beats extract's defaults; a flag beats the environment.
    specshim.configure(reset=True)
    monkeypatch.setenv("SPECSHIM_MAX_BATCHED_TOKENS", "12345")
    specshim.configure(max_batched_tokens=12345)  # what import-time loading does
    options.max_num_seqs = 7
    state = step_settings(options)
    assert state["max_num_seqs"] == {
        "value": 7,
        "source": "flag --max-num-seqs",
        "constant": "MAX_NUM_SEQS",
        "env": "SPECSHIM_MAX_NUM_SEQS",
    }
    assert state["max_batched_tokens"]["value"] == 12345
    assert state["max_batched_tokens"]["source"] == "env SPECSHIM_MAX_BATCHED_TOKENS"
    assert (
        state["cache_memory_fraction"]["value"]
        == STEP_DEFAULTS["cache_memory_fraction"]
    )
    assert generator_module.MAX_NUM_SEQS == 7
    assert generator_module.MIN_MAX_BATCHED_TOKENS == 12345

    options.cache_memory_fraction = 3.0
    with pytest.raises(SpecShimError, match=r"--cache-memory-fraction must"):
        step_settings(options)


def test_extract_takes_larger_steps_on_a_gpu(generator_module, monkeypatch, tmp_path):
    """Where vLLM does not compute on the CPU, extract's default step budget is
    GPU_STEP_DEFAULTS' (bench-gpu's choice); the environment and a flag still
    beat it, and on a CPU it is speculators' own."""
    from specshim._settings import GPU_STEP_DEFAULTS, STEP_DEFAULTS
    from specshim.job.extract import plan
    from specshim.job.extract.options import ExtractOptions

    options = ExtractOptions(model=tmp_path, data=tmp_path, out=tmp_path)
    monkeypatch.setattr(plan, "on_cpu", lambda: False)
    state = plan.step_settings(options)
    tokens = GPU_STEP_DEFAULTS["max_batched_tokens"]
    assert tokens > STEP_DEFAULTS["max_batched_tokens"]
    assert state["max_batched_tokens"]["value"] == tokens
    assert state["max_batched_tokens"]["source"] == "extract default"
    assert generator_module.MIN_MAX_BATCHED_TOKENS == tokens
    assert state["max_num_seqs"]["value"] == STEP_DEFAULTS["max_num_seqs"]
    options.max_batched_tokens = 9000
    assert plan.step_settings(options)["max_batched_tokens"]["value"] == 9000
    options.max_batched_tokens = None
    monkeypatch.setattr(plan, "on_cpu", lambda: True)
    state = plan.step_settings(options)
    assert state["max_batched_tokens"]["value"] == STEP_DEFAULTS["max_batched_tokens"]


def test_extract_flags_reach_the_options(tiny_model_dir, monkeypatch):
    from specshim import cli

    seen = {}

    def fake_extract(options):
        seen["options"] = options
        return {"written": 0, "skipped": 0, "tokens": 0, "seconds": 0.0}

    monkeypatch.setattr("specshim.job.extract.command.extract", fake_extract)
    code = cli.main(
        [
            "extract",
            "--model",
            str(tiny_model_dir("llama")),
            "--data",
            "d.jsonl",
            "--out",
            "o",
            "--max-num-seqs",
            "64",
            "--max-batched-tokens",
            "16384",
            "--cache-memory-fraction",
            "0.3",
        ]
    )
    assert code == 0
    options = seen["options"]
    assert (options.max_num_seqs, options.max_batched_tokens) == (64, 16384)
    assert options.cache_memory_fraction == 0.3


def test_extract_leaves_the_library_settings_as_it_found_them(
    generator_module, tmp_path
):
    from specshim.job.extract.command import ExtractOptions, extract
    from specshim.testing.tiny_models import build_llama

    model = build_llama(tmp_path / "model")
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    specshim.configure(max_num_seqs=12)
    options = ExtractOptions(model=model, data=data, out=tmp_path / "out")
    with pytest.raises(SpecShimError):  # empty dataset, after step_settings ran
        extract(options)
    assert generator_module.MAX_NUM_SEQS == 12
    assert generator_module.MIN_MAX_BATCHED_TOKENS == 8192
    assert specshim.settings()["max_num_seqs"]["source"] == "configure()"


@pytest.mark.parametrize(
    "name, value, said",
    [
        ("SPECSHIM_DISABLE", "state-transprot", "SPECSHIM_DISABLE names no patch: "),
        ("SPECSHIM_SHM_MIB", "lots", "SPECSHIM_SHM_MIB=lots: give the most MiB"),
        ("SPECSHIM_WRITER_THREADS", "0", "SPECSHIM_WRITER_THREADS=0: give how many"),
        ("SPECSHIM_STITCH_REGIONS", "four", "SPECSHIM_STITCH_REGIONS=four: give how"),
        ("SPECSHIM_SLAB_ROWS", "-1", "SPECSHIM_SLAB_ROWS=-1: give the most rows"),
        ("SPECSHIM_SLABS", "2x", "SPECSHIM_SLABS=2x: give how many slabs"),
    ],
)
def test_doctor_lists_a_wrong_environment_value_as_a_problem(
    generator_module, monkeypatch, capsys, name, value, said
):
    """An unknown id in SPECSHIM_DISABLE was only a Python warning (issue 48)."""
    from specshim.cli import main

    monkeypatch.setenv(name, value)
    code = main(["doctor"])
    out = capsys.readouterr().out
    assert code == 1 and said in out
    if name == "SPECSHIM_DISABLE":
        assert "state-transprot" in out
