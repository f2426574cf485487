"""The matrix's output: its progress lines, the commands run into a release's
log, and what is read back from that log."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from releases import ROOT


def _log(message: str) -> None:
    print(f"[matrix {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env
        )
    return done.returncode


def _tail(log: Path, lines: int = 6) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _summary(log: Path) -> str:
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if " passed" in line or " failed" in line or " error" in line:
            return line.strip("= ")
    return _tail(log, 3)
