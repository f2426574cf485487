"""Every patch target resolves in the installed vLLM/speculators and looks like
what its patch was written for; on vLLM 0.16.0 exactly the expected set applies."""

from __future__ import annotations

import importlib
import inspect

import pytest

import specshim
from specshim._registry import Incompatible, NotNeeded, State
from specshim.patches._util import GENERATOR, WORKER, upstream

pytestmark = pytest.mark.contract

# vLLM 0.16.0 release on the CPU platform: every patch applies. request-args
# applies for the block hasher (the release still takes eos_token_id).
EXPECTED_016_CPU = {record.patch.id: "applied" for record in specshim.records()}


@pytest.fixture(scope="module", autouse=True)
def loaded():
    for name in (GENERATOR, WORKER):
        importlib.import_module(name)


def _vllm_minor() -> tuple[int, int]:
    from packaging.version import Version

    from specshim._registry import installed_version

    release = Version(installed_version("vllm")).release
    return release[0], release[1]


@pytest.mark.parametrize("record", specshim.records(), ids=lambda r: r.patch.id)
def test_target_resolves_and_probe_accepts_it(record):
    assert record.state in (State.APPLIED, State.NOT_NEEDED), record.detail
    if record.state is State.APPLIED and record.had_attribute:
        try:
            record.patch.probe(record.original)
        except NotNeeded:
            pytest.fail("probe now says not needed on the same object")
        except Incompatible as exc:  # pragma: no cover - this is the failure
            pytest.fail(str(exc))


def test_states_on_vllm_016_match_expectations():
    if _vllm_minor() != (0, 16):
        pytest.skip("expectations recorded for vLLM 0.16")
    states = {p["id"]: p["state"] for p in specshim.report()["patches"]}
    assert states == EXPECTED_016_CPU


def test_upstream_shapes_the_patches_rely_on():
    if _vllm_minor() != (0, 16):
        pytest.skip("shapes recorded for vLLM 0.16")
    gen = importlib.import_module(GENERATOR)
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2DecoderLayer
    from vllm.model_executor.models.llama import LlamaModel

    sched_cfg = inspect.signature(upstream(gen.SchedulerConfig)).parameters
    assert sched_cfg["is_encoder_decoder"].default is inspect.Parameter.empty
    assert sched_cfg["enable_chunked_prefill"].default is True
    assert (
        inspect.signature(upstream(gen.CacheConfig))
        .parameters["enable_prefix_caching"]
        .default
        is True
    )
    assert (
        "kv_cache_specs"
        not in inspect.signature(
            upstream(gen.get_kv_cache_config_from_groups)
        ).parameters
    )
    assert "block_size" in inspect.signature(upstream(gen.Scheduler)).parameters
    request = inspect.signature(upstream(gen.Request)).parameters
    assert "eos_token_id" in request and "block_hasher" in request
    assert hasattr(upstream(gen.MultiprocExecutor), "sample_tokens")
    assert (
        "llama_4_scaling"
        in inspect.signature(DeepseekV2DecoderLayer.forward).parameters
    )
    assert hasattr(LlamaModel, "embed_input_ids")
    assert not hasattr(LlamaModel, "get_input_embeddings")


def test_speculators_is_unmodified_on_disk():
    """specshim patches at run time only; the installed files stay as shipped."""
    import hashlib
    import importlib.metadata

    dist = importlib.metadata.distribution("speculators")
    assert dist.version == "0.3.0"
    for record in dist.files or []:
        if record.hash is None or not str(record).endswith(".py"):
            continue
        data = record.locate().read_bytes()
        digest = hashlib.new(record.hash.mode, data).digest()
        import base64

        assert (
            base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == record.hash.value
        ), record


def test_doctor_lists_every_patch():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "specshim", "doctor"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for record in specshim.records():
        assert record.patch.id in out.stdout
    assert "entry point installed" in out.stdout
