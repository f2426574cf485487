"""What ``specshim run`` can prove before it hands its process to a command.

``specshim run`` loads specshim through ``_bootstrap/sitecustomize.py``, first
on PYTHONPATH. A Python started with ``-S`` runs no ``sitecustomize``, and one
started with ``-E`` or ``-I`` ignores PYTHONPATH: either would run the program
unpatched and exit 0. Those flags are visible when the command is a Python
interpreter, or a script whose ``#!`` line names one, directly or through
``env`` (``#!/usr/bin/env -S python3 -S``); then the run is refused, as it is
when ``env`` itself drops PYTHONPATH before starting a Python (``env -i``,
``env -u PYTHONPATH``, ``env PYTHONPATH=...``). What a program does later (a
child started with such a flag, or with a cleaned environment) cannot be seen
from here and is not covered.
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
    argv, where, lost = _interpreter_argv(command)
    if argv is None:
        return  # not a Python we can see: its children are on their own
    if lost:
        raise SpecShimError(
            f"{where or 'the command runs '}{argv[0]} through env, and {lost}, so "
            "specshim run cannot load specshim in it and the program would run "
            "unpatched; keep PYTHONPATH, or `import specshim` first thing in the "
            "program"
        )
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


def _interpreter_argv(command: list[str]) -> tuple[list[str] | None, str, str]:
    """The Python's own argv that ``command`` starts, how to name where it comes
    from, and how ``env`` on the way drops PYTHONPATH ("" if it does not).

    ``(None, "", "")`` when ``command`` starts no Python we can see.
    """
    where = ""
    if not _is_python(command[0]) and not _is_env(command[0]):
        interpreter = _shebang(command[0])
        if not interpreter:
            return None, "", ""
        command, where = interpreter + command, f"{command[0]}: its #! line runs "
    lost = ""
    if _is_env(command[0]):
        command, lost = _through_env(command[1:])
    if command and _is_python(command[0]):
        return command, where, lost
    return None, "", ""


def _is_env(program: str) -> bool:
    return os.path.basename(program) == "env"


def _through_env(args: list[str]) -> tuple[list[str], str]:
    """The command ``env ARGS`` runs, and how env drops PYTHONPATH on the way
    ("" if it keeps it). ``-S`` strings are split as env splits them, which is
    how a ``#!`` line passes a Python its flags through env."""
    words, lost = list(args), ""
    while words:
        word = words.pop(0)
        if word in ("-i", "-", "--ignore-environment"):
            lost = f"env {word} clears the environment (PYTHONPATH with it)"
        elif word.startswith(("-S", "--split-string")):
            text = word.split("=", 1)[1] if word.startswith("--") else word[2:]
            if not text.strip() and words and word in ("-S", "--split-string"):
                text = words.pop(0)
            words = text.split() + words
        elif word in ("-u", "--unset", "-C", "--chdir") and words:
            if word in ("-u", "--unset") and words[0] == "PYTHONPATH":
                lost = "env -u PYTHONPATH removes PYTHONPATH"
            words.pop(0)
        elif word == "--unset=PYTHONPATH":
            lost = "env --unset=PYTHONPATH removes PYTHONPATH"
        elif word == "--":
            break
        elif word.startswith("-"):
            continue  # env's other options take no argument
        elif "=" in word:
            if word.startswith("PYTHONPATH="):
                lost = "env PYTHONPATH=... replaces specshim's PYTHONPATH"
        else:
            return [word, *words], lost
    return words, lost


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
