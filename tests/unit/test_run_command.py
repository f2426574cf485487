"""``specshim run``: the shim is active in the program and in its Python children."""

from __future__ import annotations

import subprocess
import sys

CHILD = "import sys; print('child', 'specshim' in sys.modules)"
PARENT = (
    "import subprocess, sys; print('parent', 'specshim' in sys.modules); "
    f"subprocess.run([sys.executable, '-c', {CHILD!r}], check=True)"
)


def test_run_activates_specshim_in_the_program_and_its_children():
    out = subprocess.run(
        [sys.executable, "-m", "specshim", "run", "--", sys.executable, "-c", PARENT],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "parent True" in out.stdout and "child True" in out.stdout


def test_without_run_nothing_is_injected():
    out = subprocess.run(
        [sys.executable, "-c", PARENT], capture_output=True, text=True, check=True
    )
    assert "parent False" in out.stdout


def test_run_without_a_command_is_an_error():
    out = subprocess.run(
        [sys.executable, "-m", "specshim", "run"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "needs a command" in out.stderr


def test_run_with_an_unknown_command_is_an_error():
    out = subprocess.run(
        [sys.executable, "-m", "specshim", "run", "--", "no-such-program-xyz"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "command not found" in out.stderr
