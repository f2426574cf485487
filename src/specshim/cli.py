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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
