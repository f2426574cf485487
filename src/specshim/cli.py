"""The ``specshim`` command line."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from specshim._registry import SpecShimError

_TARGET_MODULES = (
    "speculators.data_generation.vllm_hidden_states_generator",
    "speculators.data_generation.custom_worker",
)


def _doctor(args: argparse.Namespace) -> int:
    import specshim

    failures = []
    for name in _TARGET_MODULES:
        try:
            importlib.import_module(name)
        except SpecShimError as exc:
            failures.append(str(exc))
        except ImportError as exc:
            failures.append(f"cannot import {name}: {exc}")
    data = specshim.report()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(specshim.format_report(data))
        for failure in failures:
            print("\n" + failure)
    bad = [p for p in data["patches"] if p["state"] in ("incompatible", "failed")]
    return 1 if failures or bad or not data["plugin"]["installed"] else 0


def _table(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specshim._table import patch_table, render_into

    if args.write:
        path = Path(args.write)
        path.write_text(render_into(path.read_text()))
    else:
        print(patch_table())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specshim._demo import run

    return run(Path(args.cache) if args.cache else None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specshim",
        description="Run speculators 0.3.0's hidden-state generator on vLLM 0.16.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser(
        "doctor",
        help="show versions, the worker plugin, and every patch's state",
        description=(
            "Import speculators' generator and worker modules with specshim "
            "active and report each patch's state.\n\nexample: specshim doctor"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_doctor)
    demo = commands.add_parser(
        "demo",
        help="run the whole path on a tiny model specshim builds itself",
        description=(
            "Build a tiny DeepSeek-V3-style MoE checkpoint (cached), run speculators' "
            "unmodified generator on vLLM's CPU backend, and check every captured "
            "layer against Hugging Face.\n\nexample: specshim demo"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--cache", help="where to keep the tiny model (default ~/.cache/specshim)")
    demo.set_defaults(func=_demo)
    table = commands.add_parser(
        "table",
        help="print the patch table (markdown) generated from the registry",
        description="example: specshim table --write README.md",
    )
    table.add_argument("--write", metavar="README", help="update the table in this file")
    table.set_defaults(func=_table)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
