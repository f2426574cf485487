"""The scheduler and cache config patches: scheduler_config_initvars,
chunked_prefill_off, prefix_caching_off, kv_cache_config_args and
scheduler_block_size, against small fakes."""

from __future__ import annotations

import pytest

from specshim._types import Incompatible, NotNeeded
from specshim.patches.main import (
    chunked_prefill_off,
    kv_cache_config_args,
    prefix_caching_off,
    scheduler_block_size,
    scheduler_config_initvars,
)

from ._main_patch_helpers import _applied, _vllm_config


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
