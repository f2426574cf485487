"""The two patches the first GPU run called for, decided on CPU.

``worker-start-method``'s question is PyTorch's own bad-fork flag, asked of a
real forked child in a fresh interpreter (this CPU host's torch is a CUDA
build, so the runtime device-count call that poisons forks on a GPU host
poisons them here too). ``finished-requests-delivered`` runs against a fake
scheduler.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from specshim._base import SpecShimError
from specshim._environ import scoped_environ
from specshim._types import Incompatible, NotNeeded
from specshim.patches.main import finished_requests_delivered as delivered
from specshim.patches.main import worker_start_method as start

VAR = start.START_METHOD


def _in_fresh_python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split()[-1]


def test_fork_is_safe_until_the_runtime_is_asked_for_devices():
    import torch

    if not torch.cuda._is_compiled():
        pytest.skip("this torch has no CUDA: no fork can be poisoned")
    verdicts = _in_fresh_python(
        """
        import torch
        from specshim.patches.main.worker_start_method import fork_breaks_cuda
        before = fork_breaks_cuda()
        torch._C._cuda_getDeviceCount()  # what torch.cuda.is_available() does
        print(f"{before},{fork_breaks_cuda()}")
        """
    )
    assert verdicts == "False,True"


def test_a_child_that_never_reports_counts_as_unsafe(monkeypatch):
    """A forked child stuck in an at-fork handler is killed, and fork refused."""
    import torch

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: os.pause())
    assert start.fork_breaks_cuda(wait_s=0.5) is True


class Executor:
    """Records the start method vLLM would read while it starts workers."""

    def __init__(self, **kwargs):
        self.method = os.environ.get(VAR)


@pytest.mark.parametrize(
    ("requested", "breaks", "seen"),
    [
        (None, True, "spawn"),
        ("fork", True, "spawn"),  # vLLM's own check overrides fork too
        (None, False, None),
        ("fork", False, "fork"),
        ("spawn", True, "spawn"),
    ],
)
def test_workers_spawn_only_where_fork_breaks_and_the_variable_comes_back(
    monkeypatch, requested, breaks, seen
):
    asked = []
    monkeypatch.setattr(start, "fork_breaks_cuda", lambda: asked.append(1) or breaks)
    if requested is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, requested)
    executor = start.PATCH.build(Executor)(vllm_config=None)
    assert executor.method == seen
    assert os.environ.get(VAR) == requested
    assert asked == ([] if requested == "spawn" else [1])


def test_start_method_not_needed_on_the_cpu_platform(monkeypatch):
    import vllm.platforms

    monkeypatch.setattr(
        vllm.platforms, "current_platform", SimpleNamespace(is_cpu=lambda: True)
    )
    with pytest.raises(NotNeeded, match="CPU platform"):
        start.PATCH.probe(Executor)


def test_scoped_environ_restores_what_vllm_changed_inside(monkeypatch):
    monkeypatch.delenv("SPECSHIM_TEST_A", raising=False)
    monkeypatch.setenv("SPECSHIM_TEST_B", "b")
    with scoped_environ({"SPECSHIM_TEST_A": "1", "SPECSHIM_TEST_B": "2"}):
        assert os.environ["SPECSHIM_TEST_A"] == "1"
        os.environ["SPECSHIM_TEST_A"] = "changed by vLLM"
    assert "SPECSHIM_TEST_A" not in os.environ
    assert os.environ["SPECSHIM_TEST_B"] == "b"


class Scheduler:
    """Finishes requests into ``finished_req_ids`` and hands that set to the
    next output, as vLLM's scheduler does."""

    def __init__(self, **kwargs):
        self.finished_req_ids: set[str] = set()
        self.plan: list[int] = []

    def finish(self, *ids: str) -> None:
        self.finished_req_ids.update(ids)

    def schedule(self):
        tokens = self.plan.pop(0) if self.plan else 0
        output = SimpleNamespace(
            total_num_scheduled_tokens=tokens, finished_req_ids=self.finished_req_ids
        )
        self.finished_req_ids = set()
        return output


def test_ids_no_step_would_deliver_wait_for_the_next_step():
    scheduler = delivered.PATCH.build(Scheduler)()
    scheduler.plan = [5]  # one step of a generate() call, then the empty one
    assert scheduler.schedule().finished_req_ids == set()
    scheduler.finish("a", "b")  # speculators aborts the step's requests
    last = scheduler.schedule()
    assert last.total_num_scheduled_tokens == 0
    scheduler.finish("never-scheduled")  # the guard's leftovers
    scheduler.plan = [3]  # the next call's first step reaches the workers
    assert scheduler.schedule().finished_req_ids == {"a", "b", "never-scheduled"}
    assert scheduler.schedule().finished_req_ids == set()


def test_ids_a_step_delivers_are_not_kept():
    scheduler = delivered.PATCH.build(Scheduler)()
    scheduler.finish("a")
    scheduler.plan = [4]
    assert scheduler.schedule().finished_req_ids == {"a"}
    assert scheduler.finished_req_ids == set()


def test_a_scheduler_without_the_set_is_refused():
    scheduler = delivered.PATCH.build(Scheduler)()
    scheduler.finish("a")
    del scheduler.__wrapped__.finished_req_ids
    scheduler.__wrapped__.schedule = lambda: SimpleNamespace(
        total_num_scheduled_tokens=0, finished_req_ids={"a"}
    )
    with pytest.raises(SpecShimError, match="never free them"):
        scheduler.schedule()


def test_delivery_needs_both_output_fields(monkeypatch):
    import importlib

    output_module = importlib.import_module(delivered._OUTPUT)
    delivered.PATCH.probe(Scheduler)  # the installed vLLM has both

    class Old:
        __dataclass_fields__ = {"total_num_scheduled_tokens": None}

    monkeypatch.setattr(output_module, "SchedulerOutput", Old)
    with pytest.raises(Incompatible, match="finished_req_ids"):
        delivered.PATCH.probe(Scheduler)
