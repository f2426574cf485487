"""``make bench-gpu``'s figures: rates, ratios against the engine's own speed,
issue 45's targets, and ``gpu.md``."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from gpu_models import MODELS, state_bytes_per_token
from plan import timing_sentence

_PEERS = ("native", "prefill")

# The targets each model's run is held to (docs/performance.md).
LLAMA_EXTRACT_VS_NATIVE = 0.85
MLA_EXTRACT_VS_PREFILL = 0.8
GENERATE_VS_PREFILL = 0.85
EXTRACT_VS_GENERATE = 0.9


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def _peer(rate: dict[str, float], name: str) -> tuple[float | None, str | None]:
    """The faster of ``name@default`` and ``name@<extract's utilization>``."""
    runs = {k.split("@", 1)[1]: v for k, v in rate.items() if k.startswith(name + "@")}
    if not runs:
        return rate.get(name), None
    setting = max(runs, key=runs.__getitem__)
    return runs[setting], setting


def targets(model: str, r: dict[str, Any]) -> dict[str, bool | None]:
    """Each of issue 45's targets that applies to ``model``: met, missed, or
    None where a figure is missing."""

    def at_least(value: float | None, bound: float) -> bool | None:
        return None if value is None else value >= bound

    found = {
        f"generate >= {GENERATE_VS_PREFILL} x prefill": at_least(
            r["generate_vs_prefill"], GENERATE_VS_PREFILL
        ),
        f"extract >= {EXTRACT_VS_GENERATE} x generate": at_least(
            r["extract_vs_generate"], EXTRACT_VS_GENERATE
        ),
    }
    if MODELS[model][0] == "llama":
        found[f"extract >= {LLAMA_EXTRACT_VS_NATIVE} x native"] = at_least(
            r["extract_vs_native"], LLAMA_EXTRACT_VS_NATIVE
        )
    else:
        found[f"extract >= {MLA_EXTRACT_VS_PREFILL} x prefill"] = at_least(
            r["extract_vs_prefill"], MLA_EXTRACT_VS_PREFILL
        )
    if model == "llama-1b":
        found["stretch: extract >= native"] = at_least(r["extract_vs_native"], 1.0)
    return found


def summarise(model: str, parts: dict[str, Any], tokens: int) -> dict[str, Any]:
    per_token = state_bytes_per_token(model)
    rate = {
        name: tokens / found["seconds"]
        for name, found in parts.items()
        if "seconds" in found
    }
    prefill, prefill_setting = _peer(rate, "prefill")
    native, native_setting = _peer(rate, "native")
    disk = parts.get("disk", {})
    extract = rate.get("extract")
    summary = {
        "model": model,
        "tokens": tokens,
        "state_bytes_per_token": per_token,
        "tok_per_s": {k: round(v) for k, v in rate.items()},
        "prefill": round(prefill) if prefill else None,
        "prefill_utilization": prefill_setting,
        "native": round(native) if native else None,
        "native_utilization": native_setting,
        "settings": {k: v["settings"] for k, v in parts.items() if "settings" in v},
        "disk": disk,
        "disk_tok_per_s": {
            k: round(disk[f"{k}_bytes_per_s"] / per_token)
            for k in ("nofsync", "fsync")
            if f"{k}_bytes_per_s" in disk
        },
        "extract_vs_native": _ratio(extract, native),
        "extract_vs_prefill": _ratio(extract, prefill),
        "generate_vs_prefill": _ratio(rate.get("generate"), prefill),
        "extract_vs_generate": _ratio(extract, rate.get("generate")),
        "native_vs_prefill": _ratio(native, prefill),
        "extract_timing": {k: v["timing"] for k, v in parts.items() if "timing" in v},
        "step_budgets": {
            k: v["max_batched_tokens"]
            for k, v in parts.items()
            if "max_batched_tokens" in v
        },
        "passes": {k: v["passes"] for k, v in parts.items() if "passes" in v},
        "errors": {k: v["error"] for k, v in parts.items() if "error" in v},
        "backends": parts.get("generate", {}).get("backends"),
        "worker_profile": parts.get("generate", {}).get("worker_profile"),
        "kv_cache_tokens": parts.get("generate", {}).get("kv_cache_tokens"),
        "generate_calls": parts.get("generate", {}).get("calls_s"),
        "reuse": parts.get("reuse") if "error" not in parts.get("reuse", {}) else None,
        "stack": _stack(),
        "date": time.strftime("%Y-%m-%d"),
    }
    summary["targets"] = targets(model, summary)
    return summary


def _stack() -> dict[str, str]:
    import importlib.metadata as md

    found = {}
    for name in ("vllm", "torch", "transformers", "speculators", "specshim"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = "absent"
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        gpu = "unknown"
    found["gpu"] = gpu
    return found


def write_results(results: Path, summary: dict[str, Any]) -> None:
    path = results / "gpu.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged[summary["model"]] = summary
    path.write_text(json.dumps(merged, indent=2) + "\n")
    (results / "gpu.md").write_text(render(merged))


def _f(value: Any) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    return "—" if value is None else str(value)


def render(merged: dict[str, Any]) -> str:
    rows = [
        "| model | prefill | native | generate() | extract | extract ÷ native | "
        "extract ÷ prefill | generate ÷ prefill | extract ÷ generate | "
        "disk, page cache / fsync |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for name, s in merged.items():
        r, d = s["tok_per_s"], s["disk_tok_per_s"]
        rows.append(
            f"| {name} | {_f(s['prefill'])} | {_f(s['native'])} | "
            f"{_f(r.get('generate'))} | {_f(r.get('extract'))} | "
            f"{_f(s['extract_vs_native'])} | {_f(s.get('extract_vs_prefill'))} | "
            f"{_f(s['generate_vs_prefill'])} | {_f(s['extract_vs_generate'])} | "
            f"{_f(d.get('nofsync'))} / {_f(d.get('fsync'))} |"
        )
        notes += _notes(name, s)
    first = next(iter(merged.values()))
    stack = ", ".join(f"{k} {v}" for k, v in first["stack"].items())
    return (
        "# make bench-gpu\n\nTokens per second of the same data set (start-up "
        "excluded); disk figures are tokens' worth of states per second.\n\n"
        + "\n".join(rows)
        + "\n\n"
        + "\n".join(notes)
        + f"\n\nStack: {stack}; {first['date']}.\n"
    )


def _notes(name: str, s: dict[str, Any]) -> list[str]:
    """What each row's figures are made of, in words."""
    notes = []
    if s.get("prefill_utilization"):
        notes.append(
            f"- {name}: prefill and native are the best of "
            f"{len(next(iter(s['passes'].values()), []))} timed passes after a "
            "warm-up, each at vLLM's default gpu_memory_utilization and at "
            f"extract's; the faster counts (prefill: {s['prefill_utilization']}, "
            f"native: {s.get('native_utilization') or 'none'}). Settings: "
            + json.dumps(s.get("settings", {}))
        )
    runs = (s.get("passes") or {}).get("extract")
    if runs:
        notes.append(
            f"- {name}: generate() is the best of its timed passes after a "
            f"warm-up call, extract the best of {len(runs)} runs, each a "
            f"process of its own (seconds: {runs})."
        )
    for label, timing in (s.get("extract_timing") or {}).items():
        notes.append(f"- {name}: {timing_sentence(label, timing)}.")
    notes += _call_notes(name, s)
    notes += _step_notes(name, s) + _thread_notes(name, s) + _batch_notes(name, s)
    notes += _profile_notes(name, s) + _reuse_notes(name, s)
    met = s.get("targets") or {}
    if met:
        notes.append(
            f"- {name}: "
            + "; ".join(
                f"{k}: {'met' if v else 'missed' if v is False else 'not measured'}"
                for k, v in met.items()
            )
        )
    if s.get("sources"):
        parts = ", ".join(f"{k}: {v}" for k, v in s["sources"].items())
        notes.append(f"- {name}'s figures came from these runs: {parts}.")
    if s.get("errors"):
        notes.append(f"- {name}: failed parts: {json.dumps(s['errors'])[:400]}")
    return notes


def _call_notes(name: str, s: dict[str, Any]) -> list[str]:
    """generate()'s calls beside extract's: the table's generate() excludes
    its first call (a warm-up), extract's rate starts at its first."""
    calls = s.get("generate_calls")
    timing = (s.get("extract_timing") or {}).get("extract") or {}
    if not calls or "generate_median" not in timing:
        return []
    return [
        f"- {name}: a generate() call took {calls['first']} s first (the "
        f"untimed warm-up) and {calls['median']} s at the median; in extract "
        f"{timing['generate_first']} s first (timed) and "
        f"{timing['generate_median']} s at the median: median against median, "
        f"extract ÷ generate {calls['median'] / timing['generate_median']:.3f}."
    ]


def _step_notes(name: str, s: dict[str, Any]) -> list[str]:
    """The step budgets the table's runs took, and the runs at other budgets."""
    notes = []
    budgets = s.get("step_budgets") or {}
    if "generate" in budgets or "extract" in budgets:
        notes.append(
            f"- {name}: the table's generate() and extract ran at "
            + ", ".join(
                f"{part} {_budget(budgets[part])}"
                for part in ("generate", "extract")
                if part in budgets
            )
            + " tokens a step."
        )
    rates = s["tok_per_s"]
    for budget in sorted({k.split("@")[1] for k in rates if "@" in k and k[0] != "p"}):
        if budget.isdigit():
            found = []
            for part, peers in (("generate", ("prefill",)), ("extract", _PEERS)):
                rate = rates.get(f"{part}@{budget}")
                if rate:
                    ratios = [
                        f"{_ratio(rate, s[peer])} of {peer}"
                        for peer in peers
                        if s.get(peer)
                    ]
                    found.append(f"{part} {rate:,} ({', '.join(ratios)})")
            notes.append(
                f"- {name}: at {int(budget):,} tokens a step (extract's "
                "--max-batched-tokens): " + ", ".join(found)
            )
    return notes


def _budget(found: Any) -> str:
    """A part's step budget as recorded: a number, or extract's ``[number,
    where it came from]``."""
    if isinstance(found, list):
        return f"{found[0]:,} ({found[1]})"
    return f"{found:,}"


def _variants(rates: dict[str, Any], prefix: str) -> list[tuple[int, Any]]:
    """The runs named ``prefix`` and a number (``extract@t4``: ``extract@t``
    and 4), as (number, rate), by number."""
    return sorted(
        (int(k[len(prefix) :]), rate)
        for k, rate in rates.items()
        if k.startswith(prefix) and k[len(prefix) :].isdigit()
    )


def _batch_notes(name: str, s: dict[str, Any]) -> list[str]:
    """generate() and extract at other call sizes (``--batch-sizes``)."""
    rates = s["tok_per_s"]
    lines = []
    for part in ("generate", "extract"):
        found = _variants(rates, f"{part}@b")
        if found:
            lines.append(
                f"- {name}: {part} at "
                + ", ".join(f"{size}: {rate:,}" for size, rate in found)
                + f" tok/s by sequences a call (at 32: {rates.get(part, 0):,})."
            )
    return lines


def _thread_notes(name: str, s: dict[str, Any]) -> list[str]:
    """extract's rate at each size of its writer's pool (``--writer-threads``)."""
    rates = s["tok_per_s"]
    found = _variants(rates, "extract@t")
    if not found:
        return []
    return [
        f"- {name}: extract with its writer's threads at "
        + ", ".join(f"{threads}: {rate:,}" for threads, rate in found)
        + f" tok/s (at its own choice: {rates.get('extract', 0):,})."
    ]


def _profile_notes(name: str, s: dict[str, Any]) -> list[str]:
    """generate() under the worker's profiler (``--worker-profile``): how much
    of its wall time the GPU was busy, and in copies."""
    found = s.get("worker_profile")
    if not found:
        return []
    copies = found.get("copies_us") or {}
    spelled = ", ".join(f"{k} {v / 1e6:.3f} s" for k, v in sorted(copies.items()))
    return [
        f"- {name}: {found['calls']} generate() calls under the worker's "
        f"profiler took {found['wall_s']} s; the GPU was busy "
        f"{found['device_us'] / 1e6:.3f} s"
        + (f", of it copies: {spelled}" if spelled else "")
        + (
            f"; {found['steps']} forward steps, "
            f"{max(found['tokens_per_step']):,} tokens in the largest"
            if found.get("tokens_per_step")
            else ""
        )
        + (
            f"; speculators' KV cache holds {s['kv_cache_tokens']:,} tokens"
            if s.get("kv_cache_tokens")
            else ""
        )
        + "."
    ]


def _reuse_notes(name: str, s: dict[str, Any]) -> list[str]:
    """``--parts reuse``: samples/s with ``--reuse-prefixes`` over without."""
    found = s.get("reuse")
    if not found:
        return []
    spelled = "; ".join(
        f"{kind} {row['speedup']:.2f}x (goal {row['goal']}x, "
        f"{'met' if row['speedup'] >= row['goal'] else 'missed'}; "
        f"{row['identical']} of {row['samples']} files bit-identical)"
        for kind, row in found.items()
    )
    return [f"- {name}: extract --reuse-prefixes over extract, samples/s: {spelled}."]
