"""Run the GPU tier as three pytest processes at once: the reference cases
(one generator at a time, in process) beside the routes (one vLLM at a time,
in subprocesses) and ``--data-parallel 1`` against a plain run (two
``extract`` commands). Both are mostly start-ups (imports, worker spawn, weight
loading), which a single GPU overlaps well; run one after the other, the tier
does not fit a 10-minute window.

Three vLLM instances at once fit any GPU here: speculators sizes its KV cache
from free memory (``0.8 * 0.2`` of it), and vLLM's start-up check asks for
``0.8`` of the total, so the later instances still find enough.
``--jobs 1`` runs the groups one after the other.

    python -m tests.gpu.tier [--jobs 1|3] [--logs DIR] [PYTEST ARGS...]

Exit status: the first non-zero status of the pytest runs, else 0. Each run's
output goes to ``DIR/<name>.log``; its last lines are printed at the end."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
# The reference cases with the exit checks; every other way in (extract,
# verify, check, the plugin, the refusals); and the data-parallel comparison,
# apart so that no group runs much longer than the others.
GROUPS = {
    "reference": ["test_reference.py", "test_exit.py"],
    "routes": ["test_paths.py"],
    "shards": ["test_data_parallel.py"],
}
TAIL = 25


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.tier")
    parser.add_argument(
        "--jobs", type=int, default=len(GROUPS), choices=(1, len(GROUPS))
    )
    parser.add_argument("--logs", type=Path, default=None)
    args, pytest_args = parser.parse_known_args(argv)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="specshim-gpu-tier-"))
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    statuses: dict[str, int] = {}
    batches = [list(GROUPS)] if args.jobs > 1 else [[name] for name in GROUPS]
    for batch in batches:
        running = {name: _start(name, logs, pytest_args) for name in batch}
        statuses.update({name: proc.wait() for name, proc in running.items()})
    for name, status in statuses.items():
        lines = (logs / f"{name}.log").read_text(errors="replace").splitlines()
        print(f"===== {name}: exit {status} (last {TAIL} lines of {logs / name}.log)")
        print("\n".join(lines[-TAIL:]))
    print(f"gpu tier: {time.monotonic() - started:.0f} s wall, logs in {logs}")
    return next((status for status in statuses.values() if status), 0)


def _start(name: str, logs: Path, pytest_args: list[str]) -> subprocess.Popen:
    files = [str(HERE / file) for file in GROUPS[name]]
    command = [sys.executable, "-m", "pytest", *files, *pytest_args]
    with open(logs / f"{name}.log", "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
