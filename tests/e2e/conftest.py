"""End-to-end fixtures: the unmodified speculators generator on vLLM's CPU backend."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

LAYERS = [1, 3, 5]
MAX_MODEL_LEN = 1024
# The Hugging Face model each fixture is checked against. Kimi-K2.5's text
# weights are exactly the tiny DeepSeek-V3's (same seed), and its text model is
# a DeepseekV3ForCausalLM.
HF_REFERENCE = {"kimi_k25": "deepseek_v3", "kimi_k25_mla": "deepseek_v3_mla"}


# Checkpoints that ship Python code (an auto_map): the tests consent to it.
SHIPS_CODE = {"kimi_k25", "kimi_k25_mla"}


def cpu_mla_step_tokens(speculators_budget: int) -> int:
    """The step budget vLLM's CPU platform leaves an MLA model on this host.

    Its reference CPU MLA path sets ``max(max_model_len,
    DEFAULT_MAX_NUM_BATCHED_TOKENS)`` itself; from 0.32 its AMX MLA kernels
    (x86 with AMX tiles) keep the budget asked for. Read from vLLM's own
    platform code and the host, not assumed: the same case runs on both kinds
    of CPU.
    """
    import inspect

    import torch
    from vllm.config import SchedulerConfig
    from vllm.platforms import CpuArchEnum, current_platform

    amx_path = "amx_mla" in inspect.getsource(type(current_platform))
    if (
        amx_path
        and current_platform.get_cpu_architecture() == CpuArchEnum.X86
        and torch.cpu._is_amx_tile_supported()
    ):
        return speculators_budget
    return max(MAX_MODEL_LEN, SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS)


def _cpu_mla_cases() -> list[Any]:
    """DeepSeek-V3 and Kimi-K2.5 on vLLM's real CPU MLA path, where vLLM has one
    (0.29+; the cases above run them with plain attention). Older releases have
    no such path to test."""
    from specshim.patches.main.cpu_mla_disable import cpu_mla_missing

    return [] if cpu_mla_missing() else [("deepseek_v3_mla", 1), ("kimi_k25_mla", 1)]


def make_generator(
    path: str,
    tp: int,
    layer_ids: list[int] | None = None,
    trust_remote_code: bool = False,
) -> Any:
    from speculators.data_generation import VllmHiddenStatesGenerator

    import specshim  # (arms the patches before speculators loads)

    specshim.configure(trust_remote_code=trust_remote_code)

    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    else:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return VllmHiddenStatesGenerator(
        str(path),
        layer_ids=LAYERS if layer_ids is None else layer_ids,
        max_model_len=MAX_MODEL_LEN,
        tensor_parallel_size=tp,
    )


# Step budgets and KV-cache fractions (``specshim.configure``) that every
# reference case must also pass: correctness may not depend on them.
BUDGETS: dict[str, dict[str, Any]] = {
    # 4 sequences and max_model_len tokens a step, a KV cache of 5%.
    "small-steps": {
        "max_num_seqs": 4,
        "max_batched_tokens": 1,
        "cache_memory_fraction": 0.05,
    },
    # Every test batch in one step.
    "large-steps": {
        "max_num_seqs": 256,
        "max_batched_tokens": 65536,
        "cache_memory_fraction": 0.6,
    },
}


def close_generator(generator: Any) -> None:
    """Shut the workers down and close the main process's queue sockets
    (what ``close-at-exit`` does for a generator still open at exit)."""
    from specshim import close

    close(generator)


def half_built(error: BaseException) -> Any:
    """The generator whose constructor raised ``error``, from its traceback;
    None if there is none."""
    frame_tb = error.__traceback__
    while frame_tb is not None:
        candidate = frame_tb.tb_frame.f_locals.get("self")
        if type(candidate).__name__ == "VllmHiddenStatesGenerator":
            return candidate
        frame_tb = frame_tb.tb_next
    return None


# Defects of vLLM's own CPU backend, reproduced with vLLM's ``LLM`` engine and
# specshim disabled (``SPECSHIM_DISABLE=all``, no speculators): they are not
# speculators' or specshim's, and only the version matrix meets them.
_DEEPSEEK_NUMERICS = (
    "vLLM {v} CPU: DeepSeek-V3 prompt logprobs differ from HF by up to 0.64 nats "
    "(mean 0.19) in vLLM's own engine, against 0.02 on 0.15 and 0.004 for Llama; "
    "single tokens match, so attention across tokens is off upstream"
)
_DEEPSEEK_WARMUP = (
    "vLLM 0.14 CPU: the unquantized MoE instantiates a CustomOp outside "
    "set_current_vllm_config during warm-up ('Current vLLM config is not set'); "
    "vLLM's own engine fails the same way"
)
UPSTREAM_CPU_DEFECTS = {
    ("deepseek_v3", (0, 12)): _DEEPSEEK_NUMERICS.format(v="0.12"),
    ("deepseek_v3", (0, 13)): _DEEPSEEK_NUMERICS.format(v="0.13"),
}
UPSTREAM_CPU_CRASHES = {("deepseek_v3", (0, 14)): _DEEPSEEK_WARMUP}
# One case, on CPUs without AMX (avx512_bf16 only): vLLM 0.11's bfloat16 MoE
# path puts 4 tokens of one 35-token sequence at cosine 0.936-0.949 against HF
# float32 at the deepest captured layer (3 are allowed), where HF in bfloat16
# stays above 0.95 and vLLM 0.16 passes. Reproduced without specshim or
# speculators: vLLM 0.11's own engine gives that batch's prompt logprobs a mean
# gap to HF of 0.017 nats (0.012 on 0.16), up to 0.29. The same case passed in
# earlier matrix runs on another host.
_DEEPSEEK_011_NO_AMX = (
    "vLLM 0.11 CPU without AMX: bfloat16 MoE near-ties put 4 of 35 tokens of one "
    "sequence at cosine 0.936-0.949 (3 allowed); vLLM's own engine's prompt "
    "logprobs are further from HF than on 0.16 (mean 0.017 vs 0.012 nats)"
)
# vLLM 0.11's CPU attention asserts that a forward holds exactly the scheduled
# tokens ("assert key.shape[0] == num_prefill_tokens + num_decode_tokens" in
# cpu_attn.py), so the worker dies on the test-only padding before the guard
# can see it; 0.12 and later run the padded forward and the guard refuses it.
_PADDING_011 = (
    "vLLM 0.11 CPU attention cannot run a padded forward (AssertionError "
    "key.shape[0] == num_prefill_tokens + num_decode_tokens): the test-only "
    "padding kills the worker before any row is captured"
)
_PADDING_CPU_MLA = (
    "vLLM's CPU MLA backend cannot run a padded forward (its KV-cache write fails "
    "'shape mismatch: value tensor of shape [89, 512] cannot be broadcast to "
    "indexing result of shape [86, 512]', seen on 0.29): the test-only padding "
    "kills the worker before any row is captured"
)
# (model, vLLM minor, test) -> (reason, CPU flag whose absence it needs or "")
UPSTREAM_CPU_CASE_DEFECTS = {
    **{
        (name, minor, "test_padded_forwards_are_refused"): (_PADDING_CPU_MLA, "")
        for name in ("deepseek_v3_mla", "kimi_k25_mla")
        for minor in ((0, 29), (0, 30), (0, 31), (0, 32))
    },
    ("deepseek_v3", (0, 11), "test_repeated_calls_with_different_batch_sizes"): (
        _DEEPSEEK_011_NO_AMX,
        "amx_bf16",
    ),
    ("llama", (0, 11), "test_padded_forwards_are_refused"): (_PADDING_011, ""),
    ("deepseek_v3", (0, 11), "test_padded_forwards_are_refused"): (_PADDING_011, ""),
}


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            return any(
                flag in line.split() for line in handle if line.startswith("flags")
            )
    except OSError:
        return False


def vllm_minor() -> tuple[int, ...]:
    from specshim._versions import installed_release

    return (installed_release("vllm") or (0, 0))[:2]


@pytest.fixture(autouse=True)
def _known_upstream_cpu_defects(request: pytest.FixtureRequest) -> None:
    """Strict xfail where vLLM's CPU backend itself is wrong (matrix only).

    The numeric defects only touch tests that compare with the HF reference;
    tests of structure (rows refused, reordered) must pass there too.
    """
    callspec = getattr(request.node, "callspec", None)
    param = callspec.params.get("generator") if callspec else None
    if param is None:
        return
    reason = None
    if "hf_reference" in request.fixturenames:
        reason = UPSTREAM_CPU_DEFECTS.get((param[0], vllm_minor()))
    case = (param[0], vllm_minor(), request.node.originalname)
    if not reason and case in UPSTREAM_CPU_CASE_DEFECTS:
        text, missing_flag = UPSTREAM_CPU_CASE_DEFECTS[case]
        reason = text if not (missing_flag and _cpu_has(missing_flag)) else None
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


# ``extended``: left out of ``make test`` (CI's minutes), run by ``make
# test-extended``. What they add is covered there by a sibling: TP=2 by Llama
# (dense) and DeepSeek-V3 (MoE), whose text model Kimi-K2.5 wraps and Qwen2's
# attention matches Llama's; each step budget by one model.
_EXTENDED = (pytest.mark.extended,)
GENERATOR_CASES = [
    ("llama", 1),
    ("qwen2", 1),
    ("deepseek_v3", 1),
    ("kimi_k25", 1),
    pytest.param(("llama", 2), marks=pytest.mark.tp2),
    pytest.param(("qwen2", 2), marks=(pytest.mark.tp2, *_EXTENDED)),
    pytest.param(("deepseek_v3", 2), marks=pytest.mark.tp2),
    pytest.param(("kimi_k25", 2), marks=(pytest.mark.tp2, *_EXTENDED)),
    ("llama", 1, "small-steps"),
    pytest.param(("deepseek_v3", 1, "small-steps"), marks=_EXTENDED),
    pytest.param(("llama", 1, "large-steps"), marks=_EXTENDED),
    ("deepseek_v3", 1, "large-steps"),
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Here rather than in the fixture's params, so that collecting these
    # cases imports no vLLM until this directory's tests are collected (the
    # GPU tier reuses the case functions and must import vLLM as late as a
    # user's script does).
    if "generator" in metafunc.fixturenames:
        metafunc.parametrize(
            "generator",
            [*GENERATOR_CASES, *_cpu_mla_cases()],
            indirect=True,
            scope="module",
            ids=lambda p: "-".join([p[0], f"tp{p[1]}", *p[2:]]),
        )


@pytest.fixture(scope="module")
def generator(request: pytest.FixtureRequest, tiny_model_dir: Any) -> Iterator[Any]:
    import specshim

    name, tp, *budget = request.param
    settings = BUDGETS[budget[0]] if budget else {}
    crash = UPSTREAM_CPU_CRASHES.get((name, vllm_minor()))
    specshim.configure(reset=True, **settings)
    try:
        gen = make_generator(
            str(tiny_model_dir(name)), tp, trust_remote_code=name in SHIPS_CODE
        )
    except Exception as exc:
        if crash and "Current vLLM config is not set" in repr(exc) + str(exc.__cause__):
            pytest.xfail(crash)
        raise
    finally:
        specshim.configure(reset=True)  # read at construction; later ones get 0.3.0's
    scheduler = gen.vllm_config.scheduler_config
    expected = {"max_num_seqs": 32, "max_batched_tokens": 8192, **settings}
    if name.endswith("_mla"):  # the real MLA path, not plain attention
        assert gen.vllm_config.model_config.use_mla is True
        # vLLM's CPU platform may set the step budget for MLA itself.
        expected["max_batched_tokens"] = cpu_mla_step_tokens(
            expected["max_batched_tokens"]
        )
    assert scheduler.max_num_seqs == expected["max_num_seqs"]
    assert scheduler.max_num_batched_tokens == max(
        expected["max_batched_tokens"], MAX_MODEL_LEN
    )
    gen.specshim_reference_name = HF_REFERENCE.get(name, name)
    from specshim._closing import worker_pids

    from .ownership import assert_left_nothing

    pids = worker_pids(gen.executor)
    try:
        yield gen
    finally:
        close_generator(gen)
    assert_left_nothing(pids)
