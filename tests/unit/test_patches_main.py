"""Each main-process patch against small fakes, including shapes only nightlies had."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from specshim._base import SpecShimError
from specshim._types import Incompatible, NotNeeded
from specshim.patches.main import (
    chunked_prefill_off,
    cpu_kv_cache_space,
    execute_then_sample,
    generate_guard,
    kv_cache_config_args,
    prefix_caching_off,
    request_args,
    rpc_unique_reply,
    scheduler_block_size,
    scheduler_config_initvars,
)


def _applied(module, original):
    module.PATCH.probe(original)
    return module.PATCH.build(original)


class SchedulerConfig016:
    def __init__(
        self,
        max_model_len,
        is_encoder_decoder,
        max_num_seqs=128,
        max_num_batched_tokens=2048,
        enable_chunked_prefill=True,
        async_scheduling=None,
    ):
        self.__dict__.update(locals())


class SchedulerConfig011:
    def __init__(
        self,
        max_num_seqs=128,
        max_model_len=None,
        max_num_batched_tokens=None,
        enable_chunked_prefill=False,
    ):
        self.__dict__.update(locals())


def test_scheduler_config_initvars_filled():
    make = _applied(scheduler_config_initvars, SchedulerConfig016)
    config = make(max_num_seqs=32, max_model_len=1024, max_num_batched_tokens=8192)
    assert config.is_encoder_decoder is False and config.max_model_len == 1024


def test_scheduler_config_initvars_not_needed_on_011():
    with pytest.raises(NotNeeded):
        scheduler_config_initvars.PATCH.probe(SchedulerConfig011)


def test_chunked_prefill_forced_off():
    make = _applied(chunked_prefill_off, SchedulerConfig016)
    assert (
        make(max_model_len=1, is_encoder_decoder=False).enable_chunked_prefill is False
    )
    with pytest.raises(NotNeeded):
        chunked_prefill_off.PATCH.probe(SchedulerConfig011)
    with pytest.raises(Incompatible):
        chunked_prefill_off.PATCH.probe(lambda max_model_len: None)


def test_stacked_scheduler_config_wrappers_see_the_upstream_signature():
    first = _applied(scheduler_config_initvars, SchedulerConfig016)
    second = _applied(chunked_prefill_off, first)  # probe looks through `first`
    config = second(max_model_len=64)
    assert config.enable_chunked_prefill is False and config.is_encoder_decoder is False


class CacheConfig:
    def __init__(
        self, block_size=16, gpu_memory_utilization=0.9, enable_prefix_caching=True
    ):
        self.__dict__.update(locals())


def test_prefix_caching_forced_off():
    make = _applied(prefix_caching_off, CacheConfig)
    assert make(block_size=16).enable_prefix_caching is False

    class Old:
        def __init__(self, block_size=16, enable_prefix_caching=None):
            pass

    with pytest.raises(NotNeeded):
        prefix_caching_off.PATCH.probe(Old)


def test_kv_cache_config_drops_removed_argument():
    def new(vllm_config, kv_cache_groups, available_memory):
        return (vllm_config, kv_cache_groups, available_memory)

    call = _applied(kv_cache_config_args, new)
    assert call(
        vllm_config=1, kv_cache_groups=2, kv_cache_specs=3, available_memory=4
    ) == (1, 2, 4)

    def old(vllm_config, kv_cache_groups, kv_cache_specs, available_memory):
        pass

    with pytest.raises(NotNeeded):
        kv_cache_config_args.PATCH.probe(old)
    with pytest.raises(Incompatible, match="available_memory"):
        kv_cache_config_args.PATCH.probe(lambda vllm_config, groups, memory: None)


def _vllm_config(block=16, dcp=1, pcp=1, caching=False):
    return SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=block,
            enable_prefix_caching=caching,
            prefix_caching_hash_algo="sha256",
        ),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp
        ),
    )


def test_scheduler_gets_engine_core_block_size():
    class Scheduler:
        def __init__(
            self,
            vllm_config,
            kv_cache_config,
            structured_output_manager,
            block_size,
            mm_registry=None,
        ):
            self.block_size = block_size

    make = _applied(scheduler_block_size, Scheduler)
    sched = make(
        vllm_config=_vllm_config(16, dcp=2),
        kv_cache_config=None,
        structured_output_manager=None,
    )
    assert sched.block_size == 32


def test_scheduler_gets_both_block_sizes_where_vllm_resolves_them(monkeypatch):
    """vLLM 0.20's shape: EngineCore asks resolve_kv_cache_block_sizes."""
    from vllm.v1.core import kv_cache_utils

    class Scheduler:
        def __init__(
            self,
            vllm_config,
            kv_cache_config,
            structured_output_manager,
            block_size,
            hash_block_size=None,
        ):
            self.sizes = (block_size, hash_block_size)

    asked = []

    def resolve(kv_cache_config, vllm_config):
        asked.append(kv_cache_config)
        return 48, 16  # e.g. groups of block sizes 16 and 48

    monkeypatch.setattr(
        kv_cache_utils, "resolve_kv_cache_block_sizes", resolve, raising=False
    )
    make = _applied(scheduler_block_size, Scheduler)
    groups = object()
    sched = make(
        vllm_config=_vllm_config(16),
        kv_cache_config=groups,
        structured_output_manager=None,
    )
    assert sched.sizes == (48, 16) and asked == [groups]


class RequestNightly:
    """The 0.16 nightly shape: no eos_token_id."""

    def __init__(
        self,
        request_id,
        prompt_token_ids,
        sampling_params,
        pooling_params,
        arrival_time=None,
        block_hasher=None,
    ):
        self.__dict__.update(locals())


class Request016:
    def __init__(
        self,
        request_id,
        prompt_token_ids,
        sampling_params,
        pooling_params,
        eos_token_id,
        arrival_time=None,
        block_hasher=None,
    ):
        self.__dict__.update(locals())


class Request011:
    def __init__(
        self,
        request_id,
        prompt_token_ids,
        sampling_params,
        pooling_params,
        eos_token_id,
        arrival_time=None,
    ):
        pass


SPECULATORS_REQUEST_KWARGS = dict(
    request_id="req_0_0",
    prompt_token_ids=[1],
    sampling_params=None,
    pooling_params=None,
    eos_token_id=2,
    arrival_time=0.0,
)


def test_request_without_eos_token_id_nightly():
    make = _applied(request_args, RequestNightly)
    req = make(**SPECULATORS_REQUEST_KWARGS)
    assert req.block_hasher is None and not hasattr(req, "eos_token_id")


def test_request_release_keeps_eos_and_gets_hasher_when_caching_is_on():
    make = _applied(request_args, Request016)
    assert make(**SPECULATORS_REQUEST_KWARGS).eos_token_id == 2
    hasher = object()
    request_args.set_block_hasher(hasher)
    try:
        assert make(**SPECULATORS_REQUEST_KWARGS).block_hasher is hasher
    finally:
        request_args.set_block_hasher(None)
    assert request_args.block_hasher_for(_vllm_config(caching=False)) is None


def test_request_not_needed_on_011():
    with pytest.raises(NotNeeded):
        request_args.PATCH.probe(Request011)


class FakeExecutor:
    """Deferred sampling and bare unique replies, like vLLM 0.16's executor."""

    def __init__(self, vllm_config):
        self.calls = []

    def execute_model(self, scheduler_output, non_block=False):
        self.calls.append(("execute_model", scheduler_output))
        return None

    def sample_tokens(self, grammar_output, non_block=False):
        self.calls.append(("sample_tokens", grammar_output))
        return "sampled"

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
    assert executor.execute_model("so") == "sampled"
    assert executor.calls == [("execute_model", "so"), ("sample_tokens", None)]
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
    assert executor.execute_model("so") == "sampled"


def test_executor_views_compose_into_one_proxy():
    from specshim.patches._util import upstream

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
    assert alone.execute_model("so") == "sampled"
    assert alone.collective_rpc("x", unique_reply_rank=0) == ["tensor0", "tensor1"]


def test_patched_classes_stay_classes_through_every_name():
    """isclass, isinstance and subclassing through each name a patch wraps in
    speculators' module (vLLM 0.16: every class patch applies here)."""
    import importlib
    import inspect

    import specshim
    from specshim._base import GENERATOR
    from specshim._types import State
    from specshim.patches._util import upstream

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


def test_cpu_torch_view_reports_kv_space_and_forwards_the_rest(monkeypatch):
    monkeypatch.setattr(cpu_kv_cache_space, "_cpu_kv_cache_space", lambda: 3 << 30)
    view = cpu_kv_cache_space.PATCH.build(torch)
    assert view.cuda.mem_get_info() == (3 << 30, 3 << 30)
    view.cuda.empty_cache()
    assert view.as_tensor([1]).dtype == torch.long
    assert isinstance(torch.zeros(1), view.Tensor)


def test_cpu_kv_space_is_the_variable_whatever_the_platform_reports(monkeypatch):
    """vLLM 0.20's platform reports the machine's memory even with the variable
    set; speculators must still get the space the user set aside."""
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "get_device_total_memory", lambda: 64 << 30)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert cpu_kv_cache_space._cpu_kv_cache_space() == 3 << 30
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert cpu_kv_cache_space._cpu_kv_cache_space() == 64 << 30


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ([], "empty batch"),
        ([[1, 2], []], "sequence 1 is empty"),
        ([[1, 320]], "token id 320"),
        ([[-1, 3]], "token id -1"),
    ],
)
def test_generate_inputs_rejected(batch, message):
    with pytest.raises(SpecShimError, match=message):
        generate_guard.check_inputs(batch, vocab_size=320, max_model_len=16)


def test_generate_input_tensor_and_long_sequences_warn(caplog):
    with caplog.at_level(logging.WARNING):
        generate_guard.check_inputs(torch.ones(3, 20, dtype=torch.long), 320, 16)
    assert "3 of 3 sequences are longer" in caplog.text


def _record(runs, rows=None):
    """A worker record: ``runs`` is a list of (token ids, first position)."""
    ids = [t for r, _ in runs for t in r]
    positions = [p + i for r, p in runs for i in range(len(r))]
    return {
        "token_ids": torch.tensor(ids, dtype=torch.long),
        "positions": torch.tensor(positions, dtype=torch.long),
        "rows": rows if rows is not None else [len(ids)],
        "problems": [],
    }


def test_prove_rows_finds_each_sequence_whatever_the_order():
    batch = [[1, 2, 3], [1, 2], [9], [1, 2]]  # shared prefix, duplicates
    record = _record([([9], 0), ([1, 2], 0), ([1, 2, 3], 0), ([1, 2], 0)])
    begin = generate_guard.prove_rows(batch, record)
    assert begin == [3, 1, 0, 6]


def test_reorder_keeps_input_order_untouched():
    batch = [[1, 2], [3]]
    results = [
        {"input_ids": torch.tensor(ids), "hidden_states": [torch.zeros(len(ids), 1)]}
        for ids in batch
    ]
    assert generate_guard.reorder(results, batch, [0, 2]) is results


@pytest.mark.parametrize(
    ("runs", "rows", "message"),
    [
        # second request never computed (did not fit the cache)
        ([([1, 2], 0)], None, "no rows computed for sequence"),
        # partial prefill: the second request's first step only
        ([([1, 2], 0), ([3], 0)], None, r"no rows computed for sequence\(s\) 1"),
        # chunked across steps: the rest starts at position 1
        ([([1, 2], 0), ([3], 0), ([4], 1)], [3, 1], "position 1"),
        # a prefix-cache hit: rows start at position 1
        ([([1, 2], 0), ([4], 1)], None, "position 1"),
        # padding rows and a duplicated request
        ([([1, 2], 0), ([3, 4], 0), ([0, 0], 0)], None, "belong to no input"),
        ([([1, 2], 0), ([1, 2], 0), ([3, 4], 0)], None, "belong to no input"),
        # the same tokens at shifted rows inside one run
        ([([1, 2, 3, 4], 0)], None, "no rows computed"),
    ],
)
def test_prove_rows_refuses_what_it_cannot_prove(runs, rows, message):
    with pytest.raises(SpecShimError, match=message):
        generate_guard.prove_rows([[1, 2], [3, 4]], _record(runs, rows))


def test_prove_rows_refuses_forwards_recorded_as_unprovable():
    record = _record([([1, 2], 0)])
    record["problems"] = ["2 rows captured for 3 embedded tokens"]
    with pytest.raises(SpecShimError, match="2 rows captured for 3"):
        generate_guard.prove_rows([[1, 2]], record)


def test_reorder_checks_shapes_before_reslicing():
    batch = [[1, 2], [3, 4]]
    results = [
        {"input_ids": torch.tensor(ids), "hidden_states": [torch.zeros(1, 1)]}
        for ids in batch
    ]
    with pytest.raises(SpecShimError, match="sequence 0 has 2 tokens but 1 rows"):
        generate_guard.reorder(results, batch, [2, 0])


class ModelConfigFake:
    """Records the limits it was built with; multimodal when ``modalities``."""

    def __init__(self, model, limit_mm_per_prompt=None, modalities=()):
        self.model = model
        self.architecture = "FakeForConditionalGeneration"
        self.limits = limit_mm_per_prompt
        self.multimodal_config = SimpleNamespace() if modalities else None
        self.modalities = list(modalities)


def _fake_modalities(config):
    return config.modalities


def test_text_only_loading_limits_every_supported_modality(monkeypatch):
    from specshim.patches.main import text_only_loading

    monkeypatch.setattr(text_only_loading, "supported_modalities", _fake_modalities)
    build = text_only_loading.PATCH.build(ModelConfigFake)
    kimi = build(model="kimi", modalities=("vision_chunk",))
    assert kimi.limits == {"vision_chunk": 0}
    both = build(model="vl", modalities=("image", "video"))
    assert both.limits == {"image": 0, "video": 0}


def test_text_only_loading_leaves_text_models_and_caller_limits(monkeypatch):
    from specshim.patches.main import text_only_loading

    monkeypatch.setattr(text_only_loading, "supported_modalities", _fake_modalities)
    build = text_only_loading.PATCH.build(ModelConfigFake)
    assert build(model="llama").limits is None
    chosen = build(model="kimi", modalities=("vision_chunk",), limit_mm_per_prompt={})
    assert chosen.limits == {}


class ModelConfig017(ModelConfigFake):
    """vLLM 0.17's shape: ``language_model_only`` limits every modality."""

    def __init__(
        self, model, limit_mm_per_prompt=None, language_model_only=False, modalities=()
    ):
        super().__init__(model, limit_mm_per_prompt, modalities)
        self.text_only = language_model_only


def test_text_only_loading_uses_language_model_only_where_it_exists(monkeypatch):
    from specshim.patches.main import text_only_loading

    def never(config):
        raise AssertionError("no processor is needed with language_model_only")

    monkeypatch.setattr(text_only_loading, "supported_modalities", never)
    build = text_only_loading.PATCH.build(ModelConfig017)
    kimi = build(model="kimi", modalities=("vision_chunk",))
    assert kimi.text_only is True and kimi.limits is None
    # What the caller chose stands.
    assert build(model="kimi", limit_mm_per_prompt={}).text_only is False
    assert build(model="kimi", language_model_only=False).text_only is False


def test_text_only_loading_needs_the_limit_parameter():
    from specshim.patches.main import text_only_loading

    def model_config(model, tokenizer=None):  # no limit_mm_per_prompt
        return None

    with pytest.raises(Incompatible):
        text_only_loading.PATCH.probe(model_config)


def test_cpu_mla_runs_only_where_vllm_can_prefill_this_width(tmp_path, monkeypatch):
    import importlib.util
    import json

    from specshim.patches.main import cpu_mla_disable

    def checkpoint(name, config):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return tmp_path / name

    wide = checkpoint("wide", {"kv_lora_rank": 512, "qk_rope_head_dim": 64})
    narrow = checkpoint("narrow", {"kv_lora_rank": 32, "qk_rope_head_dim": 32})
    kimi = checkpoint(
        "kimi", {"text_config": {"kv_lora_rank": 512, "qk_rope_head_dim": 64}}
    )
    llama = checkpoint("llama", {"model_type": "llama"})
    # This vLLM (0.16) has no CPU MLA: off for every model.
    assert cpu_mla_disable.cpu_mla_runs(wide) == (
        False,
        "no MLA backend for CPU (vLLM < 0.28)",
    )
    real = importlib.util.find_spec
    present = {"vllm.v1.attention.backends.mla.cpu_mla"}

    def find_spec(name, *args):
        return object() if name in present else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert (
        cpu_mla_disable.cpu_mla_runs(wide)[1] == "no CPU prefill for MLA (vLLM < 0.29)"
    )
    present.add("vllm.v1.attention.backends.mla.prefill.cpu_sdpa")
    assert cpu_mla_disable.cpu_mla_runs(wide)[0] is True
    assert cpu_mla_disable.cpu_mla_runs(kimi)[0] is True
    assert cpu_mla_disable.cpu_mla_runs(narrow) == (
        False,
        "MLA width 64; vLLM's CPU MLA takes 576",
    )
    assert cpu_mla_disable.cpu_mla_runs(llama)[0] is False
    assert cpu_mla_disable.cpu_mla_runs(tmp_path / "missing")[0] is False

    # Decided again for each generator; a value the user set is left alone.
    # setenv first: monkeypatch records the value before the test (delenv of
    # an unset name records nothing), so what _before sets is undone after it.
    monkeypatch.setenv("VLLM_MLA_DISABLE", "")
    monkeypatch.delenv("VLLM_MLA_DISABLE")
    monkeypatch.setattr(cpu_mla_disable, "_ours", [])
    cpu_mla_disable._before((None,), {"model_path": str(wide)})
    assert os.environ["VLLM_MLA_DISABLE"] == "0"
    cpu_mla_disable._before((None,), {"model_path": str(narrow)})
    assert os.environ["VLLM_MLA_DISABLE"] == "1"
    cpu_mla_disable._before((None,), {"model_path": str(wide)})
    assert os.environ["VLLM_MLA_DISABLE"] == "0"
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")  # the user's
    cpu_mla_disable._before((None,), {"model_path": str(wide)})
    assert os.environ["VLLM_MLA_DISABLE"] == "1"


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
    assert executor.execute_model("so") == "sampled"
    executor.__wrapped__.initialize_from_config(["kv"])  # vLLM's own call: as is
    assert executor.calls[-1] == ("initialize_from_config", ["kv"])


def test_transformers_torch_annotation_only_where_torch_is_type_checking_only(
    monkeypatch,
):
    import sys
    import types

    from specshim._base import TRANSFORMERS_CONFIG
    from specshim.patches.deps import transformers_torch_annotation as patch

    # transformers 4 (this environment) binds no such annotation.
    with pytest.raises(NotNeeded, match="no PretrainedConfig annotation"):
        patch.PATCH.probe(None)
    fake = types.ModuleType(TRANSFORMERS_CONFIG)

    class PretrainedConfig:
        dtype: "str | torch.dtype | None"  # noqa: F821, UP037 - as transformers 5

    fake.PretrainedConfig = PretrainedConfig
    monkeypatch.setitem(sys.modules, TRANSFORMERS_CONFIG, fake)
    patch.PATCH.probe(None)  # needed: torch named, not bound
    assert patch.PATCH.build(None) is torch
    with pytest.raises(NotNeeded, match="binds torch itself"):
        patch.PATCH.probe(torch)
    assert patch.PATCH.process == "main, worker"
    assert patch.PATCH.module == TRANSFORMERS_CONFIG


def test_closing_at_exit_drops_log_lines_whose_stream_is_closed(capsys):
    """vLLM 0.25+ logs its shutdown while specshim closes a generator at exit;
    a handler whose stream pytest already closed printed "--- Logging error
    ---" tracebacks after a test run's summary (seen on vLLM 0.26.0)."""
    import io

    from specshim.patches.main import close_at_exit

    closed = io.StringIO()
    closed.close()
    handler = logging.StreamHandler(closed)
    shutdown_logger = logging.getLogger("specshim.test.shutdown")
    shutdown_logger.addHandler(handler)
    shutdown_logger.setLevel(logging.INFO)
    stopped = []

    class Executor:
        def shutdown(self):
            shutdown_logger.info("[shutdown] waiting for worker exit")
            stopped.append(True)

    class Generator:
        pass

    generator = Generator()
    generator.executor = Executor()
    close_at_exit._OPEN.add(generator)
    raising = logging.raiseExceptions
    try:
        close_at_exit._close_open()
    finally:
        shutdown_logger.removeHandler(handler)
    assert stopped == [True] and "executor" not in vars(generator)
    assert "Logging error" not in capsys.readouterr().err
    assert logging.raiseExceptions is raising


def _half_built_generator(context, shutdown_error=None):
    """A generator class whose constructor starts an executor, then refuses
    (as speculators' does when a worker refuses the set-up). Its queue holds
    a connected in-process PAIR, as vLLM's spin condition does (0.24+)."""
    import zmq

    class Queue:
        def __init__(self):
            self.read_cancel_socket = context.socket(zmq.PAIR)
            self.read_cancel_socket.bind("inproc://specshim-test-cancel")
            self.write_cancel_socket = context.socket(zmq.PAIR)
            self.write_cancel_socket.connect("inproc://specshim-test-cancel")

    class Executor:
        stopped = 0

        def __init__(self):
            self.rpc_broadcast_mq = Queue()

        def shutdown(self):
            Executor.stopped += 1
            self.rpc_broadcast_mq.write_cancel_socket.send(b"cancel")
            if shutdown_error:
                raise shutdown_error

    class Generator:
        def __init__(self):
            self.executor = Executor()
            raise ValueError("run the model in bfloat16")

    return Generator, Executor


@pytest.mark.parametrize("shutdown_error", [None, RuntimeError("worker gone")])
def test_a_constructor_that_raises_is_closed_before_its_error_goes_on(shutdown_error):
    """A refusal at set-up used to leave the workers polling and the queue
    sockets open: their context's termination (its garbage collection) then
    waited forever; a pytest run on vLLM 0.24.0's CUDA build hung in its
    summary. The caller sees the constructor's error, also when closing
    fails, and the context ends at once."""
    import threading

    import zmq

    from specshim.patches.main import close_at_exit

    context = zmq.Context()
    generator_class, executor_class = _half_built_generator(context, shutdown_error)
    wrapped = close_at_exit._build(generator_class.__init__)
    generator = generator_class.__new__(generator_class)
    with pytest.raises(ValueError, match="bfloat16"):
        wrapped(generator)
    assert executor_class.stopped == 1
    assert "executor" not in vars(generator)
    assert generator not in close_at_exit._OPEN
    ended = threading.Thread(target=context.term, daemon=True)
    ended.start()
    ended.join(timeout=20)
    assert not ended.is_alive(), "the queue's zmq context did not terminate"


@pytest.mark.parametrize("user_set", [False, True])
def test_closing_waits_for_slow_workers_before_vllms_grace_period(
    monkeypatch, user_set
):
    """vLLM's 5 s grace period then SIGTERM printed a warning at a script's
    exit when a CPU worker was slow to leave (seen on vLLM 0.32.0, 2 cores):
    close() waits for the signalled workers first, unless the user set vLLM's
    own timeout."""
    from specshim.patches.main import close_at_exit

    if user_set:
        monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "5")
    else:
        monkeypatch.delenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", raising=False)
    monkeypatch.setattr(close_at_exit, "GRACE_S", 5.0)

    class Proc:
        polls = 0

        def is_alive(self):
            Proc.polls += 1
            return Proc.polls < 4  # leaves on the fourth look

    seen = []

    class Executor:
        @staticmethod
        def _ensure_worker_termination(procs):  # vLLM's: warns if alive
            seen.append([p.is_alive() for p in procs])

        def shutdown(self):
            self._ensure_worker_termination([Proc()])

    class Generator:
        pass

    generator = Generator()
    generator.executor = Executor()
    close_at_exit.close(generator)
    assert seen == ([[True]] if user_set else [[False]])


@pytest.mark.parametrize("how", ["closed", "collected"])
def test_a_generator_closed_or_collected_unmaps_its_workers_slabs(monkeypatch, how):
    """The main process kept every slab a closed generator's workers had
    handed it mapped (8 calls' states) until it exited."""
    import gc
    import types

    from specshim.patches.main import close_at_exit

    forgotten = []
    monkeypatch.setattr(close_at_exit, "forget", forgotten.append)

    class Executor:
        workers = [
            types.SimpleNamespace(proc=types.SimpleNamespace(pid=p)) for p in (11, 12)
        ]

        def shutdown(self):
            pass

    class Generator:
        def __init__(self):
            self.executor = Executor()

        def __del__(self):  # speculators' own: shuts the executor down
            self.executor.shutdown()

    generator = Generator.__new__(Generator)
    close_at_exit._build(Generator.__init__)(generator)
    if how == "closed":
        close_at_exit.close(generator)
        assert forgotten == [[11, 12]]
    del generator
    gc.collect()
    assert forgotten[-1] == [11, 12]
