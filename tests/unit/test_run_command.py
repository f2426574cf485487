"""``specshim run``: the shim is active in the program and in its Python children."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


@pytest.mark.parametrize("what", ["directory", "script without exec bit", "empty"])
def test_run_of_what_cannot_be_run_is_one_line(tmp_path, what):
    """Each was a PermissionError or ValueError traceback (issue 48)."""
    script = tmp_path / "job.py"
    script.write_text("print(1)\n")
    target = {"directory": str(tmp_path), "empty": ""}.get(what, str(script))
    out = subprocess.run(
        [sys.executable, "-m", "specshim", "run", "--", target],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1
    if what == "script without exec bit":
        assert f"run it with Python: specshim run -- python {script}" in out.stderr


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


def _run(*command):
    return subprocess.run(
        [sys.executable, "-m", "specshim", "run", "--", *command],
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["-S"], "-S"),
        (["-I"], "-I"),
        (["-E"], "-E"),
        (["-sE"], "-E"),
        (["-uIS"], "-I"),
        (["-W", "ignore", "-E"], "-E"),
        (["-Werror", "-X", "dev", "-S"], "-S"),
        (["--check-hash-based-pycs", "never", "-I"], "-I"),
    ],
)
def test_run_refuses_python_flags_that_skip_the_bootstrap(flags, named):
    out = _run(sys.executable, *flags, "-c", "print('ran')")
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1, out
    assert "ran" not in out.stdout
    assert len(lines) == 1 and lines[0].startswith("specshim run: error: "), lines
    assert f"{named} " in lines[0] and f"drop {named}" in lines[0]


@pytest.mark.parametrize(
    "flags",
    [
        ["-s", "-P", "-B"],  # no user site, safe path: PYTHONPATH still read
        ["-W", "-S"],  # -S is -W's argument (a warning filter), not a flag
    ],
)
def test_run_lets_harmless_python_flags_through(flags):
    code = "import sys; print('patched', 'specshim' in sys.modules)"
    out = _run(sys.executable, *flags, "-c", code, "-S", "-I")  # the program's args
    assert out.returncode == 0, out.stderr
    assert "patched True" in out.stdout


def test_run_refuses_a_script_whose_shebang_passes_such_a_flag(tmp_path):
    script = tmp_path / "tool"
    script.write_text(f"#!{sys.executable} -I\nprint('ran')\n")
    script.chmod(0o755)
    out = _run(str(script))
    assert out.returncode == 1 and "ran" not in out.stdout, out
    assert "drop -I" in out.stderr and str(script) in out.stderr


@pytest.mark.parametrize(
    ("shebang", "named"),
    [
        ("/usr/bin/env -S {py} -S", "drop -S"),
        ("/usr/bin/env -S {py} -E", "drop -E"),
        ("/usr/bin/env -S -i {py}", "env -i clears the environment"),
        ("/usr/bin/env -S -u PYTHONPATH {py}", "env -u PYTHONPATH"),
    ],
)
def test_run_refuses_such_a_python_started_through_env(tmp_path, shebang, named):
    """``#!/usr/bin/env -S python3 -S`` hands the flag on through env."""
    script = tmp_path / "tool"
    script.write_text(f"#!{shebang.format(py=sys.executable)}\nprint('ran')\n")
    script.chmod(0o755)
    out = _run(str(script))
    assert out.returncode == 1 and "ran" not in out.stdout, out
    assert named in out.stderr and str(script) in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_run_refuses_env_that_drops_pythonpath_before_python():
    out = _run("env", "-i", sys.executable, "-c", "print('ran')")
    assert out.returncode == 1 and "ran" not in out.stdout, out
    assert "env -i clears the environment" in out.stderr


def test_run_lets_env_through_when_it_keeps_pythonpath(tmp_path):
    script = tmp_path / "tool"
    code = "import sys; print('patched', 'specshim' in sys.modules)"
    script.write_text(f"#!/usr/bin/env -S {sys.executable} -B\n{code}\n")
    script.chmod(0o755)
    out = _run(str(script))
    assert out.returncode == 0 and "patched True" in out.stdout, out.stderr
