"""The GPU tier: unmodified speculators 0.3.0 on vLLM's CUDA build.

Every test here is skipped, with the reason, where no NVIDIA GPU is visible;
a skip is never a pass. The test process sets none of the variables that
work around the GPU failures (start method, model runner, CUDA check): it
runs the way a user's script does, so the patches must make it work.

Each model runs under vLLM's own choice of model runner ("default") and with
the V2 runner forced (``VLLM_USE_V2_MODEL_RUNNER=1``, set only around the
generator's construction, which starts its workers). What every generator
ran on (runner, attention and MoE backends) is printed at the end.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from specshim._environ import scoped_environ

from ..e2e.conftest import HF_REFERENCE, SHIPS_CODE, close_generator, make_generator
from .tier import STACKS

# Variables that would hide what the patches are for; the tier refuses to run
# under any of them.
WORKAROUNDS = (
    "VLLM_WORKER_MULTIPROC_METHOD",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "VLLM_USE_V2_MODEL_RUNNER",
)
# As this process was started (vLLM sets PYTORCH_NVML_BASED_CUDA_CHECK itself
# once imported; nothing here imports it before the first generator).
SET_AT_START = [name for name in WORKAROUNDS if name in os.environ]
RUNNERS = {"default": {}, "v2": {"VLLM_USE_V2_MODEL_RUNNER": "1"}}
# A dense Llama; DeepSeek-V3 with real MLA (a 576-wide latent, what
# FlashAttention MLA runs) and a MoE.
MODELS = ("llama", "deepseek_v3_mla")
BACKENDS: dict[str, dict[str, Any]] = {}


def gpu_count() -> int:
    """NVIDIA GPUs visible, asked of nvidia-smi: asking torch in this process
    would touch the CUDA runtime before the tests do."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    here = os.path.dirname(__file__)
    mine = [item for item in items if str(item.fspath).startswith(here)]
    if not mine:
        return
    if gpu_count() == 0:
        skip = pytest.mark.skip(reason="GPU tier: no NVIDIA GPU visible")
    elif SET_AT_START:
        names = ", ".join(SET_AT_START)
        skip = pytest.mark.skip(reason=f"GPU tier: unset {names} first")
    else:
        skip = None
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if skip is not None:
            item.add_marker(skip)


_STACKS: list[Any] = []  # the open file faulthandler writes to


def pytest_sessionfinish(session: Any) -> None:
    """The tier's run must end within 30 s of its tests: if it is still alive
    45 s after them, write every thread's stack (again every 45 s) to the file
    tests/gpu/tier.py names, so a process that does not exit says where."""
    path = os.environ.get(STACKS)
    if path:
        _STACKS.append(open(path, "w"))  # noqa: SIM115 - must outlive this hook
        faulthandler.dump_traceback_later(45, repeat=True, file=_STACKS[-1])


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for case, facts in BACKENDS.items():
        terminalreporter.write_line(f"gpu backends {case}: {facts}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "generator" in metafunc.fixturenames:
        metafunc.parametrize(
            "generator",
            [(model, runner) for model in MODELS for runner in RUNNERS],
            indirect=True,
            scope="module",
            ids=lambda p: f"{p[0]}-{p[1]}",
        )


@pytest.fixture(scope="module")
def generator(request: pytest.FixtureRequest, tiny_model_dir: Any) -> Iterator[Any]:
    from specshim.testing.worker_probes import backends

    name, runner = request.param
    with scoped_environ(RUNNERS[runner]):
        gen = make_generator(
            str(tiny_model_dir(name)), 1, trust_remote_code=name in SHIPS_CODE
        )
    facts = gen.executor.collective_rpc(backends)[0]
    BACKENDS[f"{name}-{runner}"] = facts
    if name.endswith("_mla"):
        assert gen.vllm_config.model_config.use_mla is True
    if runner == "v2":
        assert ".gpu." in facts["runner"], f"V2 forced, but ran {facts['runner']}"
    gen.specshim_reference_name = HF_REFERENCE.get(name, name)
    from specshim._closing import worker_pids

    from ..e2e.ownership import assert_left_nothing

    pids = worker_pids(gen.executor)
    try:
        yield gen
    finally:
        close_generator(gen)
    assert_left_nothing(pids)
