"""Judging the runs: agreement with HF, medians, the goals, extract's defaults."""

from __future__ import annotations

import statistics
from typing import Any

from plan import ALL_SYSTEMS, MODELS, NOISE, SWEEP

# --- agreement with the reference ---------------------------------------------


def agreement(states_file: str, reference: dict[int, list[Any]]) -> dict[str, Any]:
    """Cosine and norm of a run's saved states against the HF reference rows."""
    import torch

    from specshim.job.verify.hf_reference import (
        TOKEN_COSINE,
        TOKEN_NORM,
        norm_ratio,
        per_token_cosine,
    )

    states = torch.load(states_file)
    means, lows, bad, total = [], [], 0, 0
    norm_errors, off_norm = [], 0
    missing = sorted(set(reference) - set(states))
    for index, ref_layers in reference.items():
        if index not in states:
            continue
        for got, ref in zip(states[index], ref_layers, strict=True):
            if got.shape != ref.shape:
                return {
                    "error": f"row {index}: shape {tuple(got.shape)} vs "
                    f"{tuple(ref.shape)}"
                }
            cos = per_token_cosine(got, ref)
            means.append(cos.mean().item())
            lows.append(cos.min().item())
            bad += int((cos < TOKEN_COSINE).sum())
            ratio = norm_ratio(got, ref)
            norm_errors.append(abs(ratio.mean().item() - 1))
            off_norm += int(((ratio - 1).abs() > TOKEN_NORM).sum())
            total += cos.numel()
    return {
        "rows": len(reference) - len(missing),
        "missing_rows": missing,
        "mean_cosine": statistics.fmean(means) if means else None,
        "min_layer_mean": min(means) if means else None,
        "min_token_cosine": min(lows) if lows else None,
        "tokens_under_0_95": bad,
        "max_mean_norm_error": max(norm_errors) if norm_errors else None,
        "tokens_off_in_norm": off_norm,
        "tokens": total,
    }


def agrees(agreement: dict[str, Any] | None) -> bool:
    """Whether an ``agreement`` clears the e2e bar.

    The thresholds of ``specshim.job.verify.hf_reference``, over the whole sample:
    every sampled row present, each layer's mean cosine >= MEAN_COSINE and
    mean norm ratio within MEAN_NORM of 1, at most SHARE_BELOW of the tokens
    under TOKEN_COSINE, and as many off in norm by over TOKEN_NORM. Results
    recorded before norms were compared carry no norm figures; they are
    judged on direction alone and say so (``agreement_text``).
    """
    from specshim.job.verify.hf_reference import MEAN_COSINE, MEAN_NORM, SHARE_BELOW

    if not agreement or "error" in agreement or agreement["missing_rows"]:
        return False
    allowed = SHARE_BELOW * agreement["tokens"]
    return (
        agreement["min_layer_mean"] >= MEAN_COSINE
        and agreement["tokens_under_0_95"] <= allowed
        and agreement.get("max_mean_norm_error", 0.0) <= MEAN_NORM
        and agreement.get("tokens_off_in_norm", 0) <= allowed
    )


def agreement_text(row: dict[str, Any]) -> str:
    """A table row's agreement and order, in words."""
    a = row.get("agreement") or {}
    if "error" in a:
        return a["error"]
    if not a:
        return "-"
    norm = a.get("max_mean_norm_error")
    norm_text = (
        f"norm off by {norm:.1%} at most" if norm is not None else "norms not recorded"
    )
    return (
        f"cos mean {a['mean_cosine']:.4f}, min token {a['min_token_cosine']:.3f}, "
        f"{norm_text}; {row['rows_misplaced']} of {row['rows']} rows misplaced"
    )


# --- summary ------------------------------------------------------------------


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per model and system, the medians over the rounds; and the sweep's."""
    compare = data["compare"]
    table: dict[str, dict[str, Any]] = {}
    for model in MODELS:
        for system in ALL_SYSTEMS:
            runs = [
                r for r in compare if r["model_name"] == model and r["system"] == system
            ]
            if not runs:
                continue
            agreements = [r["agreement"] for r in runs if r.get("agreement")]
            table.setdefault(model, {})[system] = {
                "tokens_per_s": median_of(runs, "tokens_per_s"),
                "tokens_per_s_runs": [r["tokens_per_s"] for r in runs],
                "construction_s": median_of(runs, "construction_s"),
                "construction_s_runs": [r["construction_s"] for r in runs],
                "batch_size": runs[0]["batch_size"],
                "in_order": all(r["order"]["rows_misplaced"] == 0 for r in runs),
                "rows_misplaced": runs[0]["order"]["rows_misplaced"],
                "rows": runs[0]["order"]["rows"],
                "batches_out_of_order": runs[0]["order"]["batches_out_of_order"],
                "batches": runs[0]["order"]["batches"],
                "agreement": agreements[0] if agreements else None,
            }
    return {"table": table, "sweep": summarize_sweep(data)}


def summarize_sweep(data: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per model, each sweep point's median rate, agreement and order."""
    sweep: dict[str, list[dict[str, Any]]] = {}
    for model in MODELS:
        for point in SWEEP:
            runs = [
                r
                for r in data.get("sweep", [])
                if r["model_name"] == model and tuple(r["point"]) == point
            ]
            if not runs:
                continue
            agreements = [r["agreement"] for r in runs if r.get("agreement")]
            sweep.setdefault(model, []).append(
                {
                    "max_num_seqs": point[0],
                    "max_batched_tokens": point[1],
                    "cache_memory_fraction": point[2],
                    "batch_size": point[3],
                    "effective": runs[0]["effective"],
                    "tokens_per_s": median_of(runs, "tokens_per_s"),
                    "tokens_per_s_runs": [r["tokens_per_s"] for r in runs],
                    "agreement": agreements[0] if agreements else None,
                    "in_order": all(r["order"]["rows_misplaced"] == 0 for r in runs),
                }
            )
    return sweep


# --- goals --------------------------------------------------------------------


def goals(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal, what was measured, and whether it was met."""
    table, sweep = data["summary"]["table"], data["summary"]["sweep"]
    out = [g for model in MODELS for g in _model_goals(model, table.get(model, {}))]
    imp = data.get("import")
    if imp:
        out.append(
            _goal(
                "import specshim < 30 ms, no torch/vllm",
                f"median {imp['median_ms']:.1f} ms over {imp['repeats']} fresh "
                "processes",
                imp["median_ms"] < 30 and not imp["imports_torch_or_vllm"],
            )
        )
    shares = [r["profile"] for r in data["compare"] if r.get("profile")]
    if shares:
        worst = max(p["share"] for p in shares)
        out.append(
            _goal(
                "time inside specshim's wrappers < 1% of generate()",
                f"at most {worst * 100:.2f}% (cProfile, main + workers)",
                worst < 0.01,
            )
        )
    if sweep:
        points = [p for model_points in sweep.values() for p in model_points]
        out.append(
            _goal(
                "every sweep point matches HF and keeps input order",
                f"{len(points)} points",
                all(agrees(p["agreement"]) and p["in_order"] for p in points),
            )
        )
    return out


def _goal(name: str, measured: str, met: bool) -> dict[str, Any]:
    return {"goal": name, "measured": measured, "met": bool(met)}


def _model_goals(model: str, row: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    base = row.get("spec041")
    for system, how in (
        ("specshim", "speculators' budget"),
        ("specshim-tuned", "extract's budget"),
    ):
        if system in row and base:
            a, b = row[system]["tokens_per_s"], base["tokens_per_s"]
            out.append(
                _goal(
                    f"{model}: specshim ({how}) tok/s >= speculators 0.4.0.1",
                    f"{a:,.0f} vs {b:,.0f} ({a / b:.2f}x)",
                    a >= b,
                )
            )
    if "specshim" in row and base:
        a, b = row["specshim"]["construction_s"], base["construction_s"]
        out.append(
            _goal(
                f"{model}: construction no worse than 0.4.0.1",
                f"{a:.1f} s vs {b:.1f} s ({a / b:.2f}x)",
                a <= b,
            )
        )
    for system in ("specshim", "specshim-tuned"):
        if system in row:
            out.append(
                _goal(
                    f"{model}: {system} rows in input order and matching HF",
                    agreement_text(row[system]),
                    row[system]["in_order"] and agrees(row[system]["agreement"]),
                )
            )
    if "specshim" in row and "specshim-tuned" in row and model == "deepseek_v3":
        a = row["specshim-tuned"]["tokens_per_s"]
        b = row["specshim"]["tokens_per_s"]
        out.append(
            _goal(
                "deepseek_v3: tuned >= 1.3x speculators' default budget",
                f"{a:,.0f} vs {b:,.0f} ({a / b:.2f}x)",
                a >= 1.3 * b,
            )
        )
    return out


# --- extract's defaults -------------------------------------------------------


def point_of(p: dict[str, Any]) -> tuple[Any, ...]:
    """A summarized sweep point as its (seqs, tokens, fraction, batch) tuple."""
    return (
        p["max_num_seqs"],
        p["max_batched_tokens"],
        p["cache_memory_fraction"],
        p["batch_size"],
    )


def sweep_point(
    points: list[dict[str, Any]], point: tuple[Any, ...]
) -> dict[str, Any] | None:
    """The summarized point at ``point``, if it was measured."""
    return next((p for p in points if point_of(p) == tuple(point)), None)


def chosen_point(data: dict[str, Any]) -> tuple[Any, ...] | None:
    """extract's defaults: chosen on the DeepSeek model's sweep (else the first)."""
    sweep = summarize_sweep(data)
    basis = sweep.get("deepseek_v3") or next(iter(sweep.values()), None)
    return choose_extract_defaults(basis) if basis else None


def choose_extract_defaults(points: list[dict[str, Any]]) -> tuple[Any, ...]:
    """The point for ``specshim extract``: fast, correct, and frugal.

    Among the correct sweep points on the DeepSeek model within NOISE of the
    fastest, the one that asks least of accelerator memory (KV-cache fraction,
    then samples held per generate() call, then tokens per step): on a real
    model those cost GPU memory that the tiny one does not show.
    """
    good = [p for p in points if agrees(p["agreement"]) and p["in_order"]]
    best = max(p["tokens_per_s"] for p in good)
    close = [p for p in good if p["tokens_per_s"] >= best * (1 - NOISE)]
    frugal = min(
        close,
        key=lambda p: (
            p["cache_memory_fraction"],
            p["batch_size"],
            p["max_batched_tokens"],
            p["max_num_seqs"],
        ),
    )
    return point_of(frugal)
