"""One release's run: install its stack, record which patches apply (``specshim
doctor``), then the contract and end-to-end tiers, summarised from its log."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from logs import _log, _run, _summary
from releases import ROOT, e2e_models
from venvs import cpu_preload, install


def _environment(
    version: str, venv: Path, log: Path, result: dict, started: float
) -> dict[str, str] | None:
    """Install the release's stack; the environment its tiers run in, or None
    (the reason in ``result["error"]``) if it cannot be provided."""
    _log(f"{version}: installing into {venv.name}")
    reason = install(version, venv, log)
    result["install_s"] = round(time.monotonic() - started, 1)
    if reason:
        result["error"] = reason
        _log(f"{version}: {reason}")
        return None
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    try:
        preload = cpu_preload(version, venv, log)
    except RuntimeError as exc:
        result["error"] = f"cannot provide the CPU worker's libraries: {exc}"
        _log(f"{version}: {result['error']}")
        return None
    if preload:
        env["LD_PRELOAD"] = preload
        result["ld_preload"] = preload
    return env


def _doctor(python: str, env: dict[str, str], result: dict) -> bool:
    """Record vLLM's version and every patch's state; False if doctor failed."""
    doctor = subprocess.run(
        [python, "-m", "specshim", "doctor", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    try:
        report = json.loads(doctor.stdout)
        result["vllm"] = report["versions"]["vllm"]
        result["states"] = {p["id"]: p["state"] for p in report["patches"]}
    except (json.JSONDecodeError, KeyError):
        result["error"] = f"doctor failed: {doctor.stderr[-1500:]}"
        return False
    return True


def _e2e_tier(
    version: str,
    pytest: list[str],
    log: Path,
    env: dict[str, str],
    result: dict,
    jobs: int = 1,
) -> int:
    """The end-to-end reference tier, on ``jobs`` pytest processes (a
    generator's cases to one: tests/conftest.py); its pytest exit status."""
    models = e2e_models(version)
    t = time.monotonic()
    _log(f"{version}: e2e reference tier ({', '.join(models)})")
    # The step-budget variants (ids ending in -steps) run in `make test` on the
    # target release; the matrix keeps to speculators' own budget.
    # test_exit: a generator left open at exit made noise (seen on CPU from 0.25.1).
    selected = f"(({' or '.join(models)}) and not steps) or test_exit"
    e2e = [*pytest, "tests/e2e/test_reference_match.py", "tests/e2e/test_exit.py"]
    e2e += ["-k", selected]
    if jobs > 1:
        e2e += ["-n", str(jobs), "--dist", "loadgroup"]
    rc_e2e = _run(e2e, log, env)
    result["e2e"] = _summary(log)
    result["e2e_s"] = round(time.monotonic() - t, 1)
    return rc_e2e


def run_version(
    version: str, out_dir: Path, e2e: bool = True, tiers: bool = True, jobs: int = 1
) -> dict:
    venv = ROOT / f".venv-vllm{version}"
    log = out_dir / f"vllm-{version}.log"
    log.write_text("")
    result: dict = {"version": version, "ok": False}
    started = time.monotonic()
    env = _environment(version, venv, log, result, started)
    if env is None:
        return result
    python = str(venv / "bin" / "python")
    if not _doctor(python, env, result):
        return result

    if not tiers:
        result["ok"] = True
        result["total_s"] = round(time.monotonic() - started, 1)
        _log(f"{version}: states recorded (--states-only: no test tier run)")
        return result
    pytest = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    t = time.monotonic()
    _log(f"{version}: contract tier")
    rc_contract = _run(
        [*pytest, "--pyargs", "specshim.compat", "tests/contract"], log, env
    )
    result["contract"] = _summary(log)
    result["contract_s"] = round(time.monotonic() - t, 1)

    if not e2e:
        result["e2e"] = "not run (--e2e leaves this release out)"
        result["total_s"] = round(time.monotonic() - started, 1)
        result["ok"] = rc_contract == 0
        _log(f"{version}: {'ok' if result['ok'] else 'FAILED'} (contract only)")
        return result
    rc_e2e = _e2e_tier(version, pytest, log, env, result, jobs)
    result["total_s"] = round(time.monotonic() - started, 1)
    result["ok"] = rc_contract == 0 and rc_e2e == 0
    _log(
        f"{version}: {'ok' if result['ok'] else 'FAILED'} in {result['total_s']} s "
        f"(contract: {result['contract']}; e2e: {result['e2e']})"
    )
    return result
