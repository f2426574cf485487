"""What ``specshim run`` can prove before it hands its process to a command.

``specshim run`` loads specshim through ``_bootstrap/sitecustomize.py``, first
on PYTHONPATH. A Python started with ``-S`` runs no ``sitecustomize``, and one
started with ``-E`` or ``-I`` ignores PYTHONPATH: either would run the program
unpatched and exit 0. Those flags are visible when the command is a Python
interpreter, or a script whose ``#!`` line names one; then the run is refused.
What a program does later (a child started with such a flag, or with a cleaned
environment) cannot be seen from here and is not covered.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

from specshim._base import SpecShimError

# The flags that keep the bootstrap out, and why (CPython's and PyPy's meaning).
SKIPS_BOOTSTRAP = {
    "S": "does not import site (so no sitecustomize)",
    "E": "ignores PYTHONPATH",
    "I": "(isolated mode) ignores PYTHONPATH",
}
_PYTHON_NAME = re.compile(r"(python|pypy)[\d.]*t?")


def refuse_unpatched(command: list[str]) -> None:
    """Raise ``SpecShimError`` if ``command`` is a Python that skips the bootstrap."""
    argv, where = _interpreter_argv(command)
    if argv is None:
        return  # not a Python we can see: its children are on their own
    for flag in python_flags(argv[1:]):
        if flag in SKIPS_BOOTSTRAP:
            which = ", which" if where else ""
            raise SpecShimError(
                f"{where}{argv[0]} -{flag}{which} {SKIPS_BOOTSTRAP[flag]}, so "
                "specshim run cannot load specshim in it and the program would run "
                "unpatched; "
                f"drop -{flag}, or `import specshim` first thing in the program"
            )


def python_flags(args: list[str]) -> list[str]:
    """The one-letter options a Python reads from ``args``, parsed as CPython does.

    Options end at the program: a script, ``-`` (stdin), ``--``, or ``-c``/``-m``
    (the rest is theirs). ``-W`` and ``-X`` take the rest of their word or the
    next word, so ``-W -S`` is a warning filter, not ``-S``.
    """
    flags: list[str] = []
    words = iter(args)
    for word in words:
        if word in ("-", "--") or not word.startswith("-"):
            break
        if word.startswith("--"):
            if word == "--check-hash-based-pycs":
                next(words, None)  # its mode
            continue
        for at, letter in enumerate(word[1:], start=2):
            if letter in "cm":
                return flags
            if letter in "WX":
                if at == len(word):
                    next(words, None)  # the argument is the next word
                break
            flags.append(letter)
    return flags


def _interpreter_argv(command: list[str]) -> tuple[list[str] | None, str]:
    """The Python's own argv that ``command`` starts, and how to name it.

    ``(None, "")`` when ``command`` starts no Python we can see.
    """
    if _is_python(command[0]):
        return command, ""
    interpreter = _shebang(command[0])
    if interpreter and _is_python(interpreter[0]):
        return interpreter + command, f"{command[0]}: its #! line runs "
    return None, ""


def _is_python(program: str) -> bool:
    if _PYTHON_NAME.fullmatch(os.path.basename(program)):
        return True
    found = shutil.which(program)
    return found is not None and os.path.realpath(found) == os.path.realpath(
        sys.executable
    )


def _shebang(program: str) -> list[str] | None:
    """The interpreter and its one optional argument, as Linux reads a ``#!`` line."""
    path = shutil.which(program)
    if path is None:
        return None
    try:
        with open(path, "rb") as file:
            first = file.readline(256)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    # The kernel passes everything after the interpreter as one argument.
    parts = first[2:].decode(errors="replace").strip().split(None, 1)
    return parts or None
