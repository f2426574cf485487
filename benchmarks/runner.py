"""One benchmark measurement in a fresh process: one system, one model, one setting.

Run by ``benchmarks/run.py`` with the Python of the system's environment:

* ``specshim``   - ``import specshim``, then speculators 0.3.0's unmodified
  ``VllmHiddenStatesGenerator`` (the project's ``.venv``);
* ``spec041``    - speculators 0.4.0.1's generator, unmodified except for the
  CPU memory workaround below (``.venv-bench-spec041``, no specshim in it);
* ``hf``         - Hugging Face transformers in bfloat16, forward hooks on the
  same decoder layers, one sequence at a time.

Writes one JSON document to ``--out`` and the sample rows' hidden states to
``--states`` (matched to the workload by content, so order mistakes do not hide
numerical ones; order is reported separately).
This file must not import specshim at module level: ``spec041`` runs without it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _batches(seqs: list[list[int]], size: int) -> list[list[list[int]]]:
    return [seqs[i : i + size] for i in range(0, len(seqs), size)]


# --- systems ------------------------------------------------------------------


def _spec041_cpu_workaround() -> str:
    """speculators 0.4.0.1 on a machine without an accelerator.

    It sizes the KV cache from ``speculators.utils.util.mem_get_info()``, which
    returns (0, 0) when torch sees no accelerator: zero KV blocks, and the
    scheduler cannot be built. The smallest fix: the generator module's
    ``mem_get_info`` reports vLLM's CPU KV-cache space, the same number
    specshim's ``cpu-kv-cache-space`` patch gives speculators 0.3.0. Nothing
    else is changed.
    """
    import speculators.data_generation.vllm_hidden_states_generator as module
    from vllm.platforms.cpu import CpuPlatform

    space = int(CpuPlatform.get_device_total_memory())
    module.mem_get_info = lambda: (space, space)
    return f"mem_get_info() -> ({space}, {space}) (vLLM CPU KV-cache space)"


class VllmSystem:
    def __init__(self, system: str, model: str, layers: list[int], args: Any) -> None:
        self.notes: list[str] = []
        if system == "specshim":
            import specshim

            settings = {
                "max_num_seqs": args.max_num_seqs,
                "max_batched_tokens": args.max_batched_tokens,
                "cache_memory_fraction": args.cache_memory_fraction,
            }
            specshim.configure(**settings)
        from speculators.data_generation import VllmHiddenStatesGenerator

        if system == "spec041":
            self.notes.append(_spec041_cpu_workaround())
        started = time.perf_counter()
        self.generator = VllmHiddenStatesGenerator(
            model, layer_ids=layers, max_model_len=args.max_model_len
        )
        self.construction_s = time.perf_counter() - started
        scheduler = self.generator.vllm_config.scheduler_config
        self.effective = {
            "max_num_seqs": scheduler.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "kv_blocks": self.generator.vllm_config.cache_config.num_gpu_blocks,
        }

    def generate(self, batch: list[list[int]]) -> list[tuple[list[int], list[Any]]]:
        results = self.generator.generate(batch)
        return [(r["input_ids"].tolist(), r["hidden_states"]) for r in results]

    def close(self) -> None:
        self.generator.executor.shutdown()


class HFSystem:
    def __init__(self, system: str, model: str, layers: list[int], args: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.notes = ["bfloat16, forward hooks, one sequence per forward"]
        started = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.bfloat16
        ).eval()
        self.construction_s = time.perf_counter() - started
        self.layers = sorted(layers)
        self.captured: dict[int, Any] = {}
        decoder = self.model.model.layers
        for index in self.layers:

            def hook(module: Any, inputs: Any, output: Any, index: int = index) -> None:
                out = output[0] if isinstance(output, tuple) else output
                self.captured[index] = out[0].detach().clone()

            decoder[index].register_forward_hook(hook)
        self.effective: dict[str, Any] = {}

    def generate(self, batch: list[list[int]]) -> list[tuple[list[int], list[Any]]]:
        out = []
        with self.torch.inference_mode():
            for ids in batch:
                self.captured.clear()
                self.model.model(self.torch.tensor([ids]))  # no LM head: not needed
                out.append((ids, [self.captured[i] for i in self.layers]))
        return out

    def close(self) -> None:
        return None


# --- wrapper profile (specshim only) ------------------------------------------


def _worker_profile_start(worker: Any) -> None:
    import cProfile

    worker._specshim_bench_profile = cProfile.Profile()
    worker._specshim_bench_profile.enable()


def _worker_profile_stop(worker: Any, package: str) -> dict[str, float]:
    import pstats

    profile = worker._specshim_bench_profile
    profile.disable()
    return _specshim_seconds(pstats.Stats(profile), package)


def _specshim_seconds(stats: Any, package: str) -> dict[str, float]:
    """Own time (tottime) of every function defined under specshim's package dir."""
    own: dict[str, float] = {}
    for (filename, _line, name), row in stats.stats.items():
        if filename.startswith(package):
            key = f"{os.path.relpath(filename, package)}:{name}"
            own[key] = own.get(key, 0.0) + row[2]
    return own


def profile_wrappers(system: VllmSystem, batch: list[list[int]]) -> dict[str, Any]:
    """Seconds spent inside specshim's own functions during one generate() call.

    Main process: cProfile around the call. Workers: a cProfile started and
    stopped inside every worker through ``collective_rpc`` (vLLM runs a callable
    on each worker). cProfile slows everything it watches, so the share is an
    upper bound on the unprofiled overhead.
    """
    import cProfile
    import pstats

    import specshim

    package = os.path.dirname(specshim.__file__) + os.sep
    executor = system.generator.executor
    executor.collective_rpc(_worker_profile_start)
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    system.generate(batch)
    profile.disable()
    wall = time.perf_counter() - started
    workers = executor.collective_rpc(_worker_profile_stop, args=(package,))
    main = _specshim_seconds(pstats.Stats(profile), package)
    worker_total = max(sum(w.values()) for w in workers)
    top = sorted(
        {
            **{f"main {k}": v for k, v in main.items()},
            **{f"worker {k}": v for k, v in workers[0].items()},
        }.items(),
        key=lambda kv: -kv[1],
    )[:8]
    return {
        "generate_seconds_profiled": wall,
        "main_specshim_seconds": sum(main.values()),
        "worker_specshim_seconds": worker_total,
        "share": (sum(main.values()) + worker_total) / wall,
        "top": [[name, seconds] for name, seconds in top],
    }


# --- one measurement ----------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--system", choices=["specshim", "spec041", "hf"], required=True
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True, help="JSON: seqs, layers, sample")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-batched-tokens", type=int)
    parser.add_argument("--cache-memory-fraction", type=float)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--states", help="where to save the sample rows' states")
    return parser.parse_args()


def timed_passes(
    system: Any, workload: dict[str, Any], batch_size: int, count: int
) -> tuple[list[dict[str, float]], dict[str, int], dict[int, Any]]:
    """``count`` timed passes over the workload: each pass's seconds and tokens,
    how many rows came back out of input order, and the sample rows' states."""
    seqs: list[list[int]] = workload["seqs"]
    sample = set(workload["sample"])
    index_of = {tuple(ids): i for i, ids in enumerate(seqs)}
    passes = []
    order = {"rows": 0, "batches": 0, "batches_out_of_order": 0, "rows_misplaced": 0}
    states: dict[int, Any] = {}
    for _ in range(count):
        started = time.perf_counter()
        tokens = 0
        for batch in _batches(seqs, batch_size):
            results = system.generate(batch)
            tokens += sum(len(ids) for ids, _ in results)
            misplaced = sum(1 for i, (ids, _) in enumerate(results) if ids != batch[i])
            order["rows"] += len(results)
            order["batches"] += 1
            order["batches_out_of_order"] += misplaced > 0
            order["rows_misplaced"] += misplaced
            for ids, hidden in results:
                index = index_of.get(tuple(ids))
                if index in sample and index not in states:
                    states[index] = [h.float().cpu() for h in hidden]
            del results
        passes.append({"seconds": time.perf_counter() - started, "tokens": tokens})
    return passes, order, states


def main() -> int:
    args = parse_args()
    workload = json.loads(Path(args.workload).read_text())
    seqs: list[list[int]] = workload["seqs"]
    cls = HFSystem if args.system == "hf" else VllmSystem
    system = cls(args.system, args.model, workload["layers"], args)

    # One warm-up batch, not counted.
    system.generate(seqs[: args.batch_size])
    passes, order, states = timed_passes(system, workload, args.batch_size, args.passes)

    profile = None
    if args.profile and args.system == "specshim":
        profile = profile_wrappers(system, seqs[: args.batch_size])
    system.close()

    if args.states:
        import torch

        torch.save(states, args.states)
    rates = [p["tokens"] / p["seconds"] for p in passes]
    result = {
        "system": args.system,
        "model": args.model,
        "batch_size": args.batch_size,
        "settings": {
            "max_num_seqs": args.max_num_seqs,
            "max_batched_tokens": args.max_batched_tokens,
            "cache_memory_fraction": args.cache_memory_fraction,
        },
        "effective": system.effective,
        "notes": system.notes,
        "construction_s": system.construction_s,
        "passes": passes,
        "tokens_per_s": statistics.median(rates),
        "order": order,
        "profile": profile,
        "python": sys.executable,
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
