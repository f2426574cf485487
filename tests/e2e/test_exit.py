"""A user's process that never closes its generator still ends at once and
quietly: a plain script, and a pytest run with a failing test
(``close-at-exit``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import MAX_MODEL_LEN

pytestmark = pytest.mark.e2e

EXIT_WITHIN = 30  # seconds from the process's last output to its exit
RUNS_WITHIN = 600  # the whole run, vLLM's start-up included


def _build(path: Path) -> str:
    return textwrap.dedent(
        f"""
        import specshim
        from speculators.data_generation import VllmHiddenStatesGenerator

        def build():
            return VllmHiddenStatesGenerator(
                {str(path)!r}, layer_ids=[1], max_model_len={MAX_MODEL_LEN}
            )
        """
    )


def _run(
    command: list[str], marker: str, cwd: Path
) -> tuple[int, list[tuple[str, str]], float]:
    """Run, and return the exit status, the lines printed after the first one
    that contains ``marker`` (as ``(stream, text)``), and the seconds from that
    line to the exit. A process that does not end in time is killed."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[tuple[float, str, str]] = []

    def read(stream: Any, name: str) -> None:  # a worker that outlives the
        for line in stream:  # process would keep the pipe open: a thread
            lines.append((time.monotonic(), name, line.rstrip()))

    readers = [
        threading.Thread(target=read, args=(stream, name), daemon=True)
        for stream, name in ((process.stdout, "stdout"), (process.stderr, "stderr"))
    ]
    for reader in readers:
        reader.start()
    try:
        process.wait(timeout=RUNS_WITHIN)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    ended = time.monotonic()
    for reader in readers:  # the last lines; a pipe a worker keeps open
        reader.join(timeout=5)  # counts as output never printed
    lines.sort()
    seen = [i for i, (_, _, text) in enumerate(lines) if marker in text]
    assert seen, f"{marker!r} never printed:\n" + "\n".join(x for *_, x in lines[-30:])
    at = lines[seen[0]][0]
    after = [(name, text) for _, name, text in lines[seen[0] + 1 :]]
    return process.returncode, after, ended - at


def _noise(after: list[tuple[str, str]]) -> list[str]:
    """Anything on stderr, and errors or tracebacks anywhere."""
    return [
        f"{name}: {text}"
        for name, text in after
        if name == "stderr" or "Traceback" in text or "ERROR" in text
    ]


def test_a_script_that_never_closes_its_generator_exits_quietly(
    tmp_path, tiny_model_dir
):
    script = tmp_path / "user_script.py"
    script.write_text(
        _build(tiny_model_dir("llama"))
        + textwrap.dedent(
            """
            import sys

            if __name__ == "__main__":
                generator = build()  # module-level: alive until the end
                states = generator.generate([[1, 2, 3], [4, 5]])
                print("GENERATED", len(states), file=sys.stderr, flush=True)
            """
        )
    )
    rc, after, seconds = _run([sys.executable, str(script)], "GENERATED 2", tmp_path)
    assert rc == 0
    noise = _noise(after)
    assert not noise, "printed after the script's own output:\n" + "\n".join(noise)
    assert seconds < EXIT_WITHIN, f"exited {seconds:.0f} s after its last line"


def test_a_pytest_run_with_a_failing_test_exits_after_its_summary(
    tmp_path, tiny_model_dir
):
    tests = tmp_path / "test_user.py"
    tests.write_text(
        _build(tiny_model_dir("llama"))
        + textwrap.dedent(
            """
            import pytest

            @pytest.fixture(scope="module")
            def generator():
                return build()  # never closed

            def test_passes(generator):
                assert len(generator.generate([[1, 2, 3]])) == 1

            def test_fails(generator):
                generator.generate([[4, 5]])
                assert False, "a failing test"
            """
        )
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    rc, after, seconds = _run([*command, str(tests)], "1 failed, 1 passed", tmp_path)
    assert rc == 1
    assert seconds < EXIT_WITHIN, f"exited {seconds:.0f} s after its summary"
    noise = _noise(after)
    assert not noise, "printed after the summary:\n" + "\n".join(noise)
