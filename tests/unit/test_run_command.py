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


def _python_without_specshim(tmp_path):
    """A fresh virtual environment: a real Python that cannot import specshim."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")],
        check=True,
    )
    return str(tmp_path / "bare" / "bin" / "python")


def test_run_refuses_a_python_that_cannot_import_specshim(tmp_path):
    bare = _python_without_specshim(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "specshim", "run", "--", bare, "-c", "print('ran')"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1, out
    assert "ran" not in out.stdout
    assert f"{bare} cannot import specshim" in out.stderr
    assert sys.executable in out.stderr  # the Python that has it


def test_run_refuses_a_python_child_that_cannot_import_specshim(tmp_path):
    bare = _python_without_specshim(tmp_path)
    parent = (
        "import subprocess, sys; "
        f"sys.exit(subprocess.run([{bare!r}, '-c', 'print(1)']).returncode)"
    )
    out = subprocess.run(
        [sys.executable, "-m", "specshim", "run", "--", sys.executable, "-c", parent],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "cannot import specshim" in out.stderr
