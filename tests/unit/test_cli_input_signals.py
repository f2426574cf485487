"""Ending early: Ctrl-C and interrupted runs exit 130 in one line, and a
closed output pipe stays quiet."""

from __future__ import annotations

import pytest


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
