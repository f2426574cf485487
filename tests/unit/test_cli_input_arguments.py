"""Bad command-line arguments: usage errors in one line, values vLLM would
reject refused first, ``--help`` and ``--version``."""

from __future__ import annotations

import re

import pytest

from specshim.cli import main

from ._cli_input_helpers import (
    OK_LINE,
    _data,
    _extract,
    _extract_one,
    _one_line_error,
    model_fixture,  # noqa: F401 - the model fixture
)


def test_missing_model_directory(tmp_path, capsys):
    code, err = _extract(
        capsys,
        "--model",
        str(tmp_path / "nope"),
        "--data",
        _data(tmp_path, [OK_LINE]),
        "--out",
        str(tmp_path / "o"),
    )
    assert code == 2 and "no such directory" in err


def test_every_command_has_help_with_an_example(capsys):
    for command in ("extract", "verify", "demo", "run", "doctor", "table"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "example:" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["verify", "--samples", "-1"], "--samples -1: give a positive number"),
        (["verify", "--model", "/nonexistent"], "--model /nonexistent: no such"),
        (["doctor", "--model", "/nonexistent"], "--model /nonexistent: no such"),
        (["verify", "--all"], "--all needs --data"),
    ],
)
def test_bad_arguments_are_usage_errors(tmp_path, capsys, model, argv, message):
    command, *rest = argv
    args = [command]
    if command == "verify":
        args += ["--out", str(tmp_path)]
        if "--model" not in rest:
            args += ["--model", model]
    args += rest
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and message in _one_line_error(err, command)


@pytest.mark.parametrize(
    ("argv", "command", "message"),
    [
        (["extract"], "extract", "the following arguments are required: --model"),
        (["verify", "--all", "--data", "x"], "verify", "required: --model, --out"),
        (["extract", "--tp", "two"], "extract", "argument --tp: invalid int value"),
        (["bogus"], "", "invalid choice: 'bogus'"),
    ],
)
def test_what_argparse_refuses_is_one_line_too(capsys, argv, command, message):
    """argparse prints its usage block before the error; the CLI does not."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    prog = f"specshim {command}".strip()
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: "), err
    assert message in err and f"(see {prog} --help)" in err


def test_version_names_the_stack(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("specshim 0.1.0, speculators 0.3.0")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--max-model-len", "4096"],
            "--max-model-len 4096: the model has 2048 positions",
        ),
        (["--tp", "3"], r"--tp 3: the model's 4 attention heads .* \[1, 2, 4\]"),
    ],
)
def test_values_vllm_would_reject_are_refused_first(
    tmp_path, capsys, model, extra, message
):
    out = str(tmp_path / "out")
    code, err = _extract_one(capsys, tmp_path, model, out, *extra)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specshim extract: error: ")
    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_what_vllm_refuses_later_is_still_one_line(tmp_path, capsys):
    """Rope scaling stretches the positions: vLLM itself computes that limit,
    and its refusal (a pydantic error) comes out as one line too."""
    from specshim.testing.tiny_models import build_llama

    model = build_llama(
        tmp_path / "scaled",
        max_position_embeddings=256,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    out = str(tmp_path / "out")
    data = _data(tmp_path, [OK_LINE])
    code, err = _extract(
        capsys,
        "--model",
        str(model),
        "--data",
        data,
        "--out",
        out,
        "--max-model-len",
        "1024",
    )
    lines = err.strip().splitlines()
    assert code == 2, err[-2000:]
    assert lines[-1].startswith("specshim extract: error: vLLM refused these settings")
    assert "1024" in lines[-1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-num-seqs", "0"], "error: --max-num-seqs must be >= 1"),
        (["--cache-memory-fraction", "2"], "error: --cache-memory-fraction must be in"),
        (["--max-batched-tokens", "-5"], "error: --max-batched-tokens must be >= 1"),
        (["--batch-size", "0"], "error: --batch-size must be at least 1, got 0"),
        (["--tp", "0"], "error: --tp must be at least 1, got 0"),
    ],
)
def test_values_out_of_range_name_the_flag(tmp_path, capsys, model, extra, message):
    code, err = _extract_one(capsys, tmp_path, model, str(tmp_path / "o"), *extra)
    assert code == 2 and message in err, err


def test_a_patch_this_vllm_needs_turned_off_is_named(tmp_path, tiny_model_dir):
    """vLLM's refusal ('is_encoder_decoder') said nothing of the variable that
    caused it (issue 48). In a process of its own: the patches are armed at
    import."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "SPECSHIM_DISABLE": "scheduler-config-initvars"}
    done = subprocess.run(
        [sys.executable, "-m", "specshim", "extract", "--model"]
        + [str(tiny_model_dir("llama")), "--data", _data(tmp_path, [OK_LINE])]
        + ["--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr[-2000:]
    assert "SPECSHIM_DISABLE turns off scheduler-config-initvars" in last
