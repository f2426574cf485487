"""The executor patches: execute_then_sample, rpc_unique_reply and
warm_up_after_init, and how every class patch keeps its class a class."""

from __future__ import annotations

import pytest

from specshim._types import Incompatible, NotNeeded
from specshim.patches.main import execute_then_sample, rpc_unique_reply

from ._main_patch_helpers import _applied


class FakeExecutor:
    """Deferred sampling and bare unique replies, like vLLM 0.16's executor."""

    def __init__(self, vllm_config):
        self.calls = []

    def execute_model(self, scheduler_output, non_block=False):
        self.calls.append(("execute_model", scheduler_output))
        return None

    def sample_tokens(self, grammar_output, non_block=False):
        self.calls.append(("sample_tokens", grammar_output, non_block))
        return "pending" if non_block else "sampled"

    def collective_rpc(
        self,
        method,
        timeout=None,
        args=(),
        kwargs=None,
        non_block=False,
        unique_reply_rank=None,
    ):
        """Returns single result if unique_reply_rank is provided, otherwise list."""
        return (
            ["tensor0", "tensor1"] if unique_reply_rank is not None else [["a"], ["b"]]
        )

    def engine_step(self):
        return self.execute_model("internal")


def test_execute_model_is_followed_by_sample_tokens_for_speculators_only():
    make = _applied(execute_then_sample, FakeExecutor)
    executor = make(vllm_config=None)
    assert executor.execute_model("so") == "pending"  # not waited for
    assert executor.calls == [("execute_model", "so"), ("sample_tokens", None, True)]
    executor.calls.clear()
    assert executor.engine_step() is None  # vLLM's own path is untouched
    assert executor.calls == [("execute_model", "internal")]


def test_unique_reply_comes_back_as_a_list():
    make = _applied(rpc_unique_reply, _applied(execute_then_sample, FakeExecutor))
    executor = make(vllm_config=None)
    assert executor.collective_rpc("_get_captured_states", unique_reply_rank=0)[0] == [
        "tensor0",
        "tensor1",
    ]
    assert executor.collective_rpc("get_kv_cache_spec") == [["a"], ["b"]]
    assert executor.execute_model("so") == "pending"


def test_a_sample_tokens_without_non_block_is_waited_for():
    class Older(FakeExecutor):
        def sample_tokens(self, grammar_output):
            self.calls.append(("sample_tokens", grammar_output))
            return "sampled"

    executor = _applied(execute_then_sample, Older)(vllm_config=None)
    assert executor.execute_model("so") == "sampled"
    assert executor.calls == [("execute_model", "so"), ("sample_tokens", None)]


def test_executor_views_compose_into_one_proxy():
    from specshim.patches._wrappers import upstream

    once = _applied(execute_then_sample, FakeExecutor)
    both = _applied(rpc_unique_reply, once)
    assert both.__wrapped__ is FakeExecutor  # not a view of a view
    assert upstream(both) is FakeExecutor
    executor = both(vllm_config=None)
    real = executor.__wrapped__
    assert type(real) is FakeExecutor  # one proxy over the real instance
    assert isinstance(executor, FakeExecutor) and isinstance(executor, both)
    assert {"execute_model", "collective_rpc"} <= set(vars(type(executor)))
    # The first patch alone (what revert of the second restores) still works.
    alone = once(vllm_config=None)
    assert alone.execute_model("so") == "pending"
    assert alone.collective_rpc("x", unique_reply_rank=0) == ["tensor0", "tensor1"]


def test_patched_classes_stay_classes_through_every_name():
    """isclass, isinstance and subclassing through each name a patch wraps in
    speculators' module (vLLM 0.16: every class patch applies here)."""
    import importlib
    import inspect

    import specshim
    from specshim._base import GENERATOR
    from specshim._types import State
    from specshim.patches._wrappers import upstream

    generator = importlib.import_module(GENERATOR)
    names = {
        record.patch.attribute
        for record in specshim.records()
        if record.patch.module == GENERATOR
        and record.state is State.APPLIED
        and "." not in record.patch.attribute
        and inspect.isclass(upstream(getattr(generator, record.patch.attribute)))
    }
    assert names == {
        "AutoTokenizer",
        "CacheConfig",
        "ModelConfig",
        "MultiprocExecutor",
        "Request",
        "Scheduler",
        "SchedulerConfig",
    }
    for name in sorted(names):
        patched = getattr(generator, name)
        cls = upstream(patched)
        assert patched is not cls, name
        assert inspect.isclass(patched), name
        assert patched.__name__ == cls.__name__, name
        assert isinstance(cls.__new__(cls), patched), name

        class Sub(patched):  # type: ignore[misc, valid-type]
            pass

        assert issubclass(Sub, cls), name
        assert isinstance(Sub.__new__(Sub), patched), name


def test_unique_reply_not_needed_when_list_returned():
    class Old(FakeExecutor):
        def collective_rpc(
            self, method, timeout=None, args=(), kwargs=None, unique_reply_rank=None
        ):
            """Returns list of results."""

    with pytest.raises(NotNeeded):
        rpc_unique_reply.PATCH.probe(Old)


class FakeExecutor027(FakeExecutor):
    """vLLM 0.27: initialize_from_config no longer warms the workers up."""

    def initialize_from_config(self, kv_cache_configs):
        self.calls.append(("initialize_from_config", kv_cache_configs))
        self.collective_rpc("initialize_from_config", args=(kv_cache_configs,))

    def compile_or_warm_up_model(self):
        self.calls.append(("compile_or_warm_up_model", None))


def test_warm_up_follows_initialize_from_config_in_one_view():
    from specshim.patches.main import warm_up_after_init

    class FakeExecutor026(FakeExecutor):
        def initialize_from_config(self, kv_cache_configs):
            self.collective_rpc("compile_or_warm_up_model")

    with pytest.raises(NotNeeded, match="warms the workers up itself"):
        warm_up_after_init.PATCH.probe(FakeExecutor026)

    class NoWarmUp(FakeExecutor):
        def initialize_from_config(self, kv_cache_configs):
            pass

    with pytest.raises(Incompatible, match="compile_or_warm_up_model"):
        warm_up_after_init.PATCH.probe(NoWarmUp)

    make = FakeExecutor027
    for module in (execute_then_sample, rpc_unique_reply, warm_up_after_init):
        make = _applied(module, make)
    assert make.__wrapped__ is FakeExecutor027  # three views, one proxy
    executor = make(vllm_config=None)
    executor.initialize_from_config(["kv"])
    assert executor.calls == [
        ("initialize_from_config", ["kv"]),
        ("compile_or_warm_up_model", None),
    ]
    assert executor.execute_model("so") == "pending"
    executor.__wrapped__.initialize_from_config(["kv"])  # vLLM's own call: as is
    assert executor.calls[-1] == ("initialize_from_config", ["kv"])
