"""Run the GPU tier as two pytest processes sharing the GPU: the reference
cases (one generator at a time, in process) and the routes (one vLLM at a
time, in subprocesses). Both are mostly start-ups (imports, worker spawn,
weight loading), which a single GPU overlaps well.

Two at a time, never three: vLLM's start-up check asks for ``0.8`` of the
GPU's total memory free (speculators' ``gpu_memory_utilization``), and each
running instance holds about ``0.16`` of it (speculators sizes the KV cache
from ``0.8 * 0.2`` of the free memory); with two others running, the third
start-up is refused (seen on the H200: 95.9 of 139.8 GiB free, 111.8 asked).
A group starts when one ends; ``--jobs 1`` runs them one after the other, and
``--group NAME`` (repeatable) runs only those. On a fresh H200 the reference
group took 440 s (vLLM 0.24.0: the first MLA start-up compiles kernels), so
the tier has no room for a third group beside them.

    python -m tests.gpu.tier [--jobs 1|2] [--group NAME] [--logs DIR] [PYTEST ARGS...]

Exit status: the first non-zero status of the pytest runs, else 0. Each run's
output goes to ``DIR/<name>.log``; its last lines are printed at the end. A
run still alive 45 s after its tests ended writes every thread's stack to
``DIR/<name>.stacks`` (tests/gpu/conftest.py), every 45 s."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
# The reference cases with the exit checks; every other way in (extract and
# --data-parallel 1, verify, check, the plugin, the refusals).
GROUPS = {
    "reference": ["test_reference.py", "test_exit.py", "test_lifetime.py"],
    "routes": ["test_paths.py"],
}
STACKS = "SPECSHIM_GPU_TIER_STACKS"  # where a run's late stack dumps go
TAIL = 25


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.tier")
    parser.add_argument("--jobs", type=int, default=2, choices=(1, 2))
    parser.add_argument("--group", action="append", choices=list(GROUPS))
    parser.add_argument("--logs", type=Path, default=None)
    args, pytest_args = parser.parse_known_args(argv)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="specshim-gpu-tier-"))
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    waiting = list(args.group or GROUPS)
    running: dict[str, subprocess.Popen] = {}
    statuses: dict[str, int] = {}
    while waiting or running:
        while waiting and len(running) < args.jobs:
            name = waiting.pop(0)
            running[name] = _start(name, logs, pytest_args)
        time.sleep(1)
        for name in [n for n, proc in running.items() if proc.poll() is not None]:
            statuses[name] = running.pop(name).returncode
            print(
                f"{name}: exit {statuses[name]} at {time.monotonic() - started:.0f} s"
            )
            stacks = _stacks(logs, name)
            if stacks.exists() and not stacks.stat().st_size:
                stacks.unlink()  # the run ended in time: no dump, no file
    for name, status in statuses.items():
        lines = (logs / f"{name}.log").read_text(errors="replace").splitlines()
        print(f"===== {name}: exit {status} (last {TAIL} lines of {logs / name}.log)")
        print("\n".join(lines[-TAIL:]))
    print(f"gpu tier: {time.monotonic() - started:.0f} s wall, logs in {logs}")
    return next((status for status in statuses.values() if status), 0)


def _stacks(logs: Path, name: str) -> Path:
    """Where a group's late stack dumps go (tests/gpu/conftest.py writes them)."""
    return logs / f"{name}.stacks"


def _start(name: str, logs: Path, pytest_args: list[str]) -> subprocess.Popen:
    files = [str(HERE / file) for file in GROUPS[name]]
    command = [sys.executable, "-m", "pytest", *files, *pytest_args]
    env = dict(os.environ, **{STACKS: str(_stacks(logs, name))})
    with open(logs / f"{name}.log", "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
