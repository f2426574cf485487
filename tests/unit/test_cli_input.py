"""``specshim extract`` refuses bad input clearly, before loading a model."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from specshim.cli import main

from .. import dataset_helpers


@pytest.fixture
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def _data(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _extract(capsys, *args):
    code = main(["extract", *args])
    return code, capsys.readouterr().err


OK_LINE = json.dumps({"input_ids": [1, 2, 3]})


@pytest.mark.parametrize(
    ("lines", "extra", "message"),
    [
        ([OK_LINE, "{not json"], [], "data.jsonl:2: not valid JSON"),
        (
            [OK_LINE, json.dumps({"prompt": "x"})],
            [],
            "data.jsonl:2: expected an object",
        ),
        (
            [OK_LINE, json.dumps({"input_ids": [1, 320]})],
            [],
            "data.jsonl:2: token id 320 is outside",
        ),
        ([json.dumps({"input_ids": [-4]})], [], "token id -4"),
        ([json.dumps({"input_ids": [1, "a"]})], [], "list of integers"),
        ([json.dumps({"input_ids": []})], [], "no tokens"),
        (["", "  "], [], "the dataset is empty"),
        ([OK_LINE], ["--layers", "1,6"], "--layers [6] out of range: the model has 6"),
        ([OK_LINE], ["--layers", "3,1"], "increasing order"),
        ([OK_LINE], ["--layers", "a"], "comma-separated integers"),
        ([OK_LINE], ["--shard", "2/2"], "need 0 <= I < N"),
        ([OK_LINE], ["--shard", "one"], "not of the form I/N"),
        # Data that parses but cannot be used.
        (
            [OK_LINE, '{"text": "a \\ud800 b"}'],
            [],
            "data.jsonl:2: text that is not valid",
        ),
        (
            [OK_LINE, json.dumps({"messages": ["hi", "there"]})],
            [],
            "data.jsonl:2: each chat turn must be an object",
        ),
        (
            [OK_LINE, '{"input_ids": [1], "x": ' + "[" * 100000 + "]" * 100000 + "}"],
            [],
            "data.jsonl:2: JSON nested too deeply",
        ),
        (
            [OK_LINE, '{"input_ids": [' + "9" * 5000 + "]}"],
            [],
            "data.jsonl:2: unusable",
        ),
    ],
)
def test_bad_input_is_refused_before_model_load(
    tmp_path, capsys, model, lines, extra, message
):
    out = tmp_path / "out"
    code, err = _extract(
        capsys,
        "--model",
        model,
        "--data",
        _data(tmp_path, lines),
        "--out",
        str(out),
        *extra,
    )
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err  # one line, no traceback
    assert not list(out.glob("*.pt")) if out.exists() else True


def test_a_table_column_json_cannot_hold_is_one_line(tmp_path, capsys, model):
    import datasets

    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"input_ids": [1, 2], "blob": b"\x00\x01"}]).to_parquet(
        str(path)
    )
    capsys.readouterr()  # datasets' own progress bar
    code, err = _extract(
        capsys, "--model", model, "--data", str(path), "--out", str(tmp_path / "o")
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "d.parquet: row 1: a field JSON cannot hold" in err


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


def test_missing_data_file(tmp_path, capsys, model):
    code, err = _extract(
        capsys,
        "--model",
        model,
        "--data",
        str(tmp_path / "x.jsonl"),
        "--out",
        str(tmp_path / "o"),
    )
    assert code == 2 and "no such file" in err


@pytest.mark.timeout(120)  # before the fix: it waited for a writer forever
@pytest.mark.parametrize("name", ["d.jsonl", "d.parquet"])
def test_data_that_is_no_regular_file_is_refused_at_once(tmp_path, capsys, model, name):
    import os

    fifo = tmp_path / name
    os.mkfifo(fifo)
    code, err = _extract(
        capsys, "--model", model, "--data", str(fifo), "--out", str(tmp_path / "o")
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--data {fifo}: not a regular file or a directory" in err


def test_over_length_samples_are_truncated_with_a_count(tmp_path, model, caplog):
    lines = [json.dumps({"input_ids": [1] * n}) for n in (10, 40, 50)]
    with caplog.at_level(logging.WARNING):
        samples, total = dataset_helpers.load_samples(
            Path(_data(tmp_path, lines)), Path(model), 320, 31, (0, 1)
        )
    assert total == 3 and [len(s.input_ids) for s in samples] == [10, 31, 31]
    assert "2 of 3 samples are longer than max_model_len - 1 = 31" in caplog.text


def test_shards_partition_the_dataset(tmp_path, model):
    lines = [json.dumps({"input_ids": [i + 1]}) for i in range(7)]
    data = Path(_data(tmp_path, lines))
    seen = []
    for index in range(3):
        samples, _ = dataset_helpers.load_samples(
            data, Path(model), 320, 100, (index, 3)
        )
        seen += [s.index for s in samples]
        assert all(s.index % 3 == index for s in samples)
    assert sorted(seen) == list(range(7))


def test_chat_lines_use_speculators_loss_mask(tmp_path, model):
    line = json.dumps(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo!"},
            ]
        }
    )
    (sample,), _ = dataset_helpers.load_samples(
        Path(_data(tmp_path, [line])), Path(model), 320, 100, (0, 1)
    )
    assert sum(sample.loss_mask) == 3  # "yo!": one byte token each, assistant only
    text = json.dumps({"text": "abc"})
    (sample,), _ = dataset_helpers.load_samples(
        Path(_data(tmp_path, [text])), Path(model), 320, 100, (0, 1)
    )
    assert sample.loss_mask == [1] * len(sample.input_ids)


def test_every_command_has_help_with_an_example(capsys):
    for command in ("extract", "verify", "demo", "run", "doctor", "table"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "example:" in capsys.readouterr().out


def _one_line_error(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err  # one sentence, no traceback
    assert lines[0].startswith(f"specshim {command}: error: "), err
    return lines[0]


def test_out_is_a_file(tmp_path, capsys, model):
    target = tmp_path / "taken"
    target.write_text("x")
    code, err = _extract(
        capsys,
        "--model",
        model,
        "--data",
        _data(tmp_path, [OK_LINE]),
        "--out",
        str(target),
    )
    assert code == 2 and "is a file; give a directory" in _one_line_error(
        err, "extract"
    )


def test_out_where_no_directory_can_be_made(tmp_path, capsys, model):
    # /proc takes no new directories, even for root (CI runs as root).
    code, err = _extract(
        capsys,
        "--model",
        model,
        "--data",
        _data(tmp_path, [OK_LINE]),
        "--out",
        "/proc/specshim-x/out",
    )
    assert code == 2 and "cannot create the output directory" in _one_line_error(
        err, "extract"
    )


def test_non_utf8_data_names_the_line(tmp_path, capsys, model):
    data = tmp_path / "d.jsonl"
    data.write_bytes(OK_LINE.encode() + b"\n" + b'{"text": "\xff\xfe"}\n')
    code, err = _extract(
        capsys, "--model", model, "--data", str(data), "--out", str(tmp_path / "o")
    )
    assert code == 2 and "d.jsonl:2: not UTF-8 text" in _one_line_error(err, "extract")


def test_utf8_byte_order_mark_is_accepted(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + OK_LINE.encode() + b"\n")
    records, total = dataset_helpers.read_records(data)
    assert total == 1 and records[0].data == {"input_ids": [1, 2, 3]}


@pytest.mark.parametrize("command", ["extract", "verify"])
def test_corrupt_data_config_is_an_error_sentence(tmp_path, capsys, model, command):
    out = tmp_path / "o"
    out.mkdir()
    (out / "data_config.json").write_text("{oops")
    args = ["--model", model, "--out", str(out)]
    if command == "extract":
        args += ["--data", _data(tmp_path, [OK_LINE])]
    code = main([command, *args])
    err = capsys.readouterr().err
    assert code == 1 and "data_config.json is corrupt" in _one_line_error(err, command)


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


def test_table_into_a_closed_pipe_is_quiet():
    import subprocess
    import sys

    run = subprocess.run(
        f"{sys.executable} -m specshim table | head -1",
        shell=True,
        capture_output=True,
        text=True,
        executable="/bin/bash",
    )
    assert run.stdout.startswith("| patch |") and "Traceback" not in run.stderr


def test_default_layers_are_distinct():
    from specshim.job.checkpoint import choose_layers

    assert choose_layers(None, 6) == [2, 3, 5]  # speculators would take 2, 3, 3, 5
    assert choose_layers(None, 32) == [2, 16, 29, 31]


def test_summary_counts_in_words():
    from specshim.cli import summary

    one = {"written": 1, "skipped": 0, "tokens": 1, "seconds": 1.0}
    assert "wrote 1 sample (0 already there)" in summary(one, Path("o"))
    assert "1 token at" in summary(one, Path("o"))
    two = one | {"written": 2, "rewritten": {"why": 2}}
    assert "wrote 2 samples, 2 of them rewritten" in summary(two, Path("o"))


def test_cpu_kv_space_follows_the_job_and_the_flag(monkeypatch, model):
    from specshim._base import UsageError
    from specshim.job.checkpoint import read_model
    from specshim.job.kv_cache import cpu_kv_space, kv_need

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    per_token = read_model(Path(model)).kv_bytes_per_token
    assert per_token is not None and per_token > 0
    need = kv_need(8192, 2048, per_token, 0.8, 0.5)
    assert cpu_kv_space(None, need) == (1, "the job's need")
    huge = kv_need(1 << 30, 2048, per_token, 0.8, 0.5)  # capped by the machine
    gib, _ = cpu_kv_space(None, huge)
    import os

    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 1 <= gib <= available // 2 // (1 << 30)
    with pytest.raises(UsageError, match="give --cpu-kv-space-gib"):
        cpu_kv_space(None, None)  # a config that does not say enough
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert cpu_kv_space(None, need) == (3, "VLLM_CPU_KVCACHE_SPACE")
    assert cpu_kv_space(2, need) == (2, "--cpu-kv-space-gib")


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
    code, err = _extract(
        capsys,
        "--model",
        model,
        "--data",
        _data(tmp_path, [OK_LINE]),
        "--out",
        out,
        *extra,
    )
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
    code, err = _extract(
        capsys,
        "--model",
        model,
        "--data",
        _data(tmp_path, [OK_LINE]),
        "--out",
        str(tmp_path / "o"),
        *extra,
    )
    assert code == 2 and message in err, err


@pytest.mark.parametrize(
    ("command", "line"),
    [
        (
            "extract",
            "specshim extract: interrupted: every file written is whole; "
            "rerun the same command to resume",
        ),
        ("verify", "specshim verify: interrupted"),
    ],
)
def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys, command, line):
    """Ctrl-C in any command: one line, no traceback, the shell's status for
    a command SIGINT ended (it was a KeyboardInterrupt traceback, status 1
    from --data-parallel)."""
    from specshim import cli

    def stopped(args):
        raise KeyboardInterrupt

    parser = cli.build_parser
    monkeypatch.setattr(
        cli,
        "build_parser",
        lambda: _with_handler(parser(), command, stopped),
    )
    assert cli.main([command, *ARGS[command]]) == 130
    assert capsys.readouterr().err.splitlines() == [line]


def test_an_interrupted_data_parallel_run_exits_130(monkeypatch, capsys):
    from specshim import cli
    from specshim._base import InterruptedRunError

    def stopped(args):
        raise InterruptedRunError("interrupted: every shard was stopped")

    parser = cli.build_parser
    monkeypatch.setattr(
        cli, "build_parser", lambda: _with_handler(parser(), "extract", stopped)
    )
    assert cli.main(["extract", *ARGS["extract"]]) == 130
    err = capsys.readouterr().err.splitlines()
    assert err == ["specshim extract: interrupted: every shard was stopped"]


ARGS = {
    "extract": ["--model", "m", "--data", "d.jsonl", "--out", "o"],
    "verify": ["--model", "m", "--out", "o"],
}


def _with_handler(parser, command, handler):
    """The parser, its ``command`` subcommand calling ``handler``."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            action.choices[command].set_defaults(func=handler)
    return parser


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
