"""The judged results as markdown, charts and the results block of
docs/performance.md."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from judge import agrees, sweep_point
from plan import (
    ALL_SYSTEMS,
    BATCH,
    DEFAULT_POINT,
    LABELS,
    LAYERS,
    MODEL_LABELS,
    MODELS,
)

from specshim._base import SpecShimError
from specshim._blocks import Block

RESULTS_BLOCK = Block("<!-- bench:begin -->", "<!-- bench:end -->")
BENCH_MD = Path(__file__).resolve().parent / "results" / "bench.md"


def labels(data: dict[str, Any]) -> dict[str, str]:
    """Each system's label: the defaults, then those the run recorded."""
    return {**LABELS, **data.get("labels", {})}


# --- tables -------------------------------------------------------------------


def comparison_markdown(data: dict[str, Any]) -> str:
    table, names = data["summary"]["table"], labels(data)
    lines = [
        "| model | system | tokens/s (median) | construction (s) | cosine vs HF fp32: "
        "mean / min token | input order |",
        "|---|---|---:|---:|---|---|",
    ]
    for model in MODELS:
        for system in ALL_SYSTEMS:
            row = table.get(model, {}).get(system)
            if not row:
                continue
            a = row.get("agreement") or {}
            cos = (
                f"{a['mean_cosine']:.4f} / {a['min_token_cosine']:.3f}"
                if a.get("mean_cosine") is not None
                else "-"
            )
            order = (
                "kept"
                if row["in_order"]
                else f"**wrong**: {row['rows_misplaced']} rows in "
                f"{row['batches_out_of_order']}/{row['batches']} batches"
            )
            lines.append(
                f"| {MODEL_LABELS[model]} | {names[system]} | "
                f"{row['tokens_per_s']:,.0f} | {row['construction_s']:.1f} | "
                f"{cos} | {order} |"
            )
    return "\n".join(lines)


def sweep_markdown(data: dict[str, Any]) -> str:
    lines = [
        "| model | max_num_seqs | max_batched_tokens | cache fraction "
        "(KV blocks) | batch size | tokens/s (median; runs) | vs defaults | "
        "matches HF, in order |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for model, points in data["summary"]["sweep"].items():
        base = sweep_point(points, DEFAULT_POINT)
        for p in points:
            ratio = p["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
            ok = "yes" if agrees(p["agreement"]) and p["in_order"] else "**no**"
            runs = ", ".join(f"{r:,.0f}" for r in p["tokens_per_s_runs"])
            lines.append(
                f"| {MODEL_LABELS[model]} | {p['max_num_seqs']} | "
                f"{p['max_batched_tokens']} | {p['cache_memory_fraction']} "
                f"({p['effective']['kv_blocks']}) | {p['batch_size']} | "
                f"{p['tokens_per_s']:,.0f} ({runs}) | {ratio:.2f}x | {ok} |"
            )
    return "\n".join(lines)


def goals_markdown(data: dict[str, Any]) -> str:
    lines = ["| goal | measured | met |", "|---|---|---|"]
    for g in data["goals"]:
        lines.append(
            f"| {g['goal']} | {g['measured']} | {'yes' if g['met'] else '**NO**'} |"
        )
    return "\n".join(lines)


def profile_markdown(data: dict[str, Any]) -> str:
    profiles = [r for r in data["compare"] if r.get("profile")]
    if not profiles:
        return ""
    lines = [
        "| model | generate() (s, profiled) | specshim main (s) | "
        "specshim worker (s) | share | top function |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in profiles:
        p = r["profile"]
        top = p["top"][0][0] if p["top"] else "-"
        lines.append(
            f"| {MODEL_LABELS[r['model_name']]} | "
            f"{p['generate_seconds_profiled']:.2f} | "
            f"{p['main_specshim_seconds']:.4f} | "
            f"{p['worker_specshim_seconds']:.4f} | {p['share'] * 100:.2f}% | "
            f"`{top}` |"
        )
    return "\n".join(lines)


def summary_text(data: dict[str, Any]) -> str:
    """What the CLI prints once the outputs are written."""
    parts = [comparison_markdown(data), goals_markdown(data)]
    if data["summary"]["sweep"]:
        parts.append(sweep_markdown(data))
    return "\n" + "\n\n".join(parts)


# --- files --------------------------------------------------------------------


def markdown(data: dict[str, Any]) -> str:
    """``bench.md``."""
    meta = data["meta"]
    parts = [
        "# Benchmark results",
        "",
        f"Measured {meta['date']} on {meta['machine']} by `make bench` "
        f"({meta['rounds']} interleaved rounds, median; {meta['num_seqs']} sequences, "
        f"{meta['tokens']:,} tokens, lengths uniform in [64, 1024], seed 0; layers "
        f"{list(LAYERS)}; {BATCH} sequences per generate(); one warm-up batch not "
        "counted). vLLM 0.16.0 CPU backend for both vLLM systems.",
        "",
        "## Side by side",
        "",
        comparison_markdown(data),
        "",
        "## Goals",
        "",
        goals_markdown(data),
        "",
    ]
    if data["summary"]["sweep"]:
        seqs, tokens, fraction, batch = data["extract_defaults"]
        parts += [
            "## Step budget, KV-cache fraction and batch size (specshim)",
            "",
            f"{meta['sweep_rounds']} interleaved rounds per point.",
            "",
            sweep_markdown(data),
            "",
            f"Fastest correct point on the DeepSeek model: max_num_seqs {seqs}, "
            f"max_batched_tokens {tokens}, cache_memory_fraction {fraction}, "
            f"batch size {batch}.",
            "",
            "![sweep](sweep.png)",
            "",
        ]
    prof = profile_markdown(data)
    if prof:
        parts += [
            "## Time inside specshim's wrappers (one generate() of 32 sequences)",
            "",
            prof,
            "",
        ]
    parts += ["## Notes", ""] + [f"- {n}" for n in data["notes"]] + [""]
    return "\n".join(parts)


def results_block(data: dict[str, Any], page: Path) -> str:
    """The content of the bench block in ``page`` (its link is relative to it)."""
    meta = data["meta"]
    link = Path(os.path.relpath(BENCH_MD, page.resolve().parent)).as_posix()
    return (
        f"Measured by `make bench` on {meta['machine']} ({meta['date']}; "
        f"{meta['tokens']:,} tokens per pass, median of {meta['rounds']} "
        "interleaved rounds). Details, the sweep and the goals: "
        f"[benchmarks/results/bench.md]({link}).\n\n" + comparison_markdown(data)
    )


def write_results_block(data: dict[str, Any], page: Path) -> None:
    try:
        RESULTS_BLOCK.write(page, results_block(data, page))
    except SpecShimError as error:
        raise SystemExit(f"bench: {error}") from None


def write_charts(data: dict[str, Any], out: Path) -> None:
    """``bench.png`` (the comparison) and, after a sweep, ``sweep.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _bars(plt, data["summary"]["table"], labels(data), out / "bench.png")
    if data["summary"]["sweep"]:
        _sweep_lines(plt, data["summary"]["sweep"], out / "sweep.png")


def _bars(plt: Any, table: dict[str, Any], names: dict[str, str], path: Path) -> None:
    shown = [m for m in MODELS if m in table]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    shown_systems = [s for s in ALL_SYSTEMS if any(s in table[m] for m in shown)]
    width = 0.8 / len(shown_systems)
    for k, system in enumerate(shown_systems):
        xs, ys, low, high = [], [], [], []
        for m, model in enumerate(shown):
            row = table.get(model, {}).get(system)
            if row:
                runs = row["tokens_per_s_runs"]
                xs.append(m + (k - (len(shown_systems) - 1) / 2) * width)
                ys.append(row["tokens_per_s"])
                low.append(row["tokens_per_s"] - min(runs))
                high.append(max(runs) - row["tokens_per_s"])
        if xs:
            bars = ax.bar(
                xs, ys, width, yerr=[low, high], capsize=3, label=names[system]
            )
            ax.bar_label(bars, labels=[f"{y:,.0f}" for y in ys], fontsize=7, padding=2)
    ax.set_xticks(range(len(shown)), [MODEL_LABELS[m] for m in shown])
    ax.set_ylabel("tokens/s (median; bars: min-max)")
    ax.set_title("Hidden-state extraction on vLLM 0.16's CPU backend")
    top = max(
        (r["tokens_per_s_runs"] for m in shown for r in table[m].values()),
        key=max,
        default=[1],
    )
    ax.set_ylim(0, max(top) * 1.5)  # room for the legend above the bars
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _sweep_lines(plt: Any, sweep: dict[str, list[dict[str, Any]]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for model, points in sweep.items():
        ticks = [
            f"{p['max_num_seqs']}/{p['max_batched_tokens'] // 1024}k/"
            f"{p['cache_memory_fraction']}/b{p['batch_size']}"
            for p in points
        ]
        ax.plot(
            ticks,
            [p["tokens_per_s"] for p in points],
            marker="o",
            label=MODEL_LABELS[model],
        )
    ax.set_xlabel("max_num_seqs / max_batched_tokens / cache fraction / batch size")
    ax.set_ylabel("tokens/s")
    ax.set_title("specshim: step budget and batch size")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_all(data: dict[str, Any], out: Path, page: Path | None) -> None:
    """bench.json, bench.md, the charts and, given ``page``, its results block."""
    (out / "bench.json").write_text(json.dumps(data, indent=2, default=str))
    (out / "bench.md").write_text(markdown(data))
    write_charts(data, out)
    if page:
        write_results_block(data, page)
