"""The ``specshim`` command line (also ``python -m specshim``)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from specshim._base import INTERRUPTED, InterruptedRunError, SpecShimError, UsageError
from specshim._settings import KNOBS


@contextlib.contextmanager
def _stdout_to_stderr() -> Any:
    """Send everything written to stdout meanwhile to stderr, at the fd level.

    vLLM logs to stdout, in this process and in its worker processes (which
    inherit fd 1); a command's own result must be the only thing on stdout.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _checkpoint(args: argparse.Namespace, flag: str = "--model") -> Path:
    """The checkpoint directory, checked, its code consented to or refused.

    Runs before anything is loaded from it.
    """
    from specshim import configure
    from specshim._remote_code import require_consent
    from specshim.job.inputs.checkpoint import text_config

    model = Path(args.model)
    text_config(model, flag)  # a directory with a readable config.json
    if getattr(args, "trust_remote_code", False):
        configure(trust_remote_code=True)
    require_consent(model, flag=True)
    return model


def _doctor(args: argparse.Namespace) -> int:
    import specshim

    # vLLM logs to stdout; keep stdout for the report itself (valid --json).
    from specshim._base import HOOKED_MODULES
    from specshim._report import environment_problems

    if args.model:
        _checkpoint(args)
    with _stdout_to_stderr():
        failures = []
        for name in HOOKED_MODULES:
            try:
                importlib.import_module(name)
            except SpecShimError as exc:
                failures.append(str(exc))
            except ImportError as exc:
                failures.append(f"cannot import {name}: {exc}")
        data = specshim.report()
        failures += environment_problems(data)
        if args.model and not failures:
            from specshim._report import model_report

            data["model"] = model_report(args.model)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(specshim.format_report(data))
        if "model" in data:
            from specshim._report import format_model_report

            print("\n" + format_model_report(data["model"]))
        for failure in failures:
            print("\n" + failure)
    bad = [p for p in data["patches"] if p["state"] in ("incompatible", "failed")]
    bad += [k for k in data["settings"].values() if k.get("error")]  # SPECSHIM_*
    plugin = data["plugin"]
    return (
        1 if failures or bad or not (plugin["installed"] and plugin["allowed"]) else 0
    )


def _check(args: argparse.Namespace) -> int:
    from specshim.compat import format_checks, run_checks

    with contextlib.redirect_stdout(sys.stderr):
        checks = run_checks()
    if args.json:
        print(json.dumps([check.__dict__ for check in checks], indent=2))
    else:
        print(format_checks(checks))
    return 0 if all(check.ok for check in checks) else 1


def _table(args: argparse.Namespace) -> int:
    from specshim._table import drift_table, patch_table, write_tables

    for name in args.write or ():
        write_tables(Path(name))
    if not args.write:
        print(drift_table() if args.drift else patch_table())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from specshim.job.demo import run

    return run(Path(args.cache) if args.cache else None)


def _extract(args: argparse.Namespace) -> int:
    if args.data_parallel is not None:
        return _extract_parallel(args)
    from specshim.job.extract.command import extract
    from specshim.job.extract.options import ExtractOptions, parse_layers
    from specshim.job.inputs.dataset import parse_shard

    options = ExtractOptions(
        model=_checkpoint(args),
        data=Path(args.data),
        out=Path(args.out),
        layers=parse_layers(args.layers),
        max_model_len=args.max_model_len,
        tp=args.tp,
        batch_size=args.batch_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        shard=parse_shard(args.shard),
        split=args.split,
        column=args.column,
        **{knob.name: getattr(args, knob.name) for knob in KNOBS},
        cpu_kv_space_gib=args.cpu_kv_space_gib,
        move_orphans=args.move_orphans,
        reuse_prefixes=args.reuse_prefixes,
        reuse_cap_mib=args.reuse_cap_mib,
    )
    with _stdout_to_stderr():
        counts = extract(options)
    print(summary(counts, options.out))
    return 0


def _extract_parallel(args: argparse.Namespace) -> int:
    """``extract --data-parallel N``: N shard runs of this command at once."""
    from specshim.job.extract.parallel import plan_slots, run_parallel, visible_gpus
    from specshim.job.inputs.dataset import cluster_shard

    if args.shard is not None and args.shard != "auto":
        raise UsageError(
            f"--data-parallel gives each of its runs a shard itself; drop --shard "
            f"{args.shard} (--shard auto splits this host's cluster shard among "
            "them)"
        )
    host = cluster_shard(os.environ) if args.shard == "auto" else None
    slots = plan_slots(args.data_parallel, args.tp, host, visible_gpus())
    _checkpoint(args)  # refused here once, not in each child
    out = Path(args.out)
    dataset = {"split": args.split, "column": args.column}
    counts = run_parallel(slots, _extract_argv(args), out, Path(args.data), dataset)
    print(summary(counts, out))
    return 0


def _extract_argv(args: argparse.Namespace) -> list[str]:
    """This ``extract`` command's arguments, less --data-parallel and --shard,
    rebuilt from the parser's own list (each child adds its --shard)."""
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "name"]
    argv = ["-v", "extract"] if args.verbose else ["extract"]
    for action in commands.choices["extract"]._actions:
        if not action.option_strings or action.dest in _NOT_PASSED:
            continue
        value = getattr(args, action.dest, None)
        if value is None or value is False:
            continue
        argv.append(action.option_strings[0])
        if action.nargs != 0:
            argv.append(str(value))
    return argv


_NOT_PASSED = {"help", "data_parallel", "shard"}


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def summary(counts: dict[str, Any], out: Path) -> str:
    """The one line ``extract`` prints on stdout."""
    rate = counts["tokens"] / counts["seconds"] if counts["seconds"] else 0.0
    rewritten = sum(counts.get("rewritten", {}).values())
    again = f", {rewritten} of them rewritten" if rewritten else ""
    return (
        f"extract: wrote {_plural(counts['written'], 'sample')}{again} "
        f"({counts['skipped']} already there) to {out}; "
        f"{_plural(counts['tokens'], 'token')} at {rate:,.0f} tok/s"
    )


def _verify(args: argparse.Namespace) -> int:
    from specshim.job.verify.command import verify, verify_all

    model = _checkpoint(args)
    samples = args.samples
    if samples is not None and samples < 1:
        raise UsageError(f"--samples {samples}: give a positive number")
    if args.tp is not None and args.tp < 1:
        raise UsageError(f"--tp {args.tp}: give a positive number")
    if args.all and not args.data:
        raise UsageError("--all needs --data: the dataset the files came from")
    code = 0
    if args.all:
        with _stdout_to_stderr():
            code, lines = verify_all(
                model, Path(args.out), Path(args.data), args.split, args.column
            )
        print("\n".join(lines), flush=True)
        if samples is None:
            return code
    count = 8 if samples is None else samples
    with _stdout_to_stderr():  # vLLM logs while the solo reference runs
        checked, lines = verify(
            model, Path(args.out), count, args.seed, args.reference, args.tp
        )
    print("\n".join(lines), flush=True)
    return max(code, checked)


def _status(args: argparse.Namespace) -> int:
    from specshim.job.status import collect, render

    data = Path(args.data) if args.data else None
    status = collect(Path(args.out), data, split=args.split, column=args.column)
    print("\n".join(render(status, Path(args.out))))
    return 0 if status.complete else 1


def _export(args: argparse.Namespace) -> int:
    from specshim.job.export.command import ExportOptions, export

    counts = export(
        ExportOptions(
            out=Path(args.out),
            dest=Path(args.dest),
            to=args.to,
            model=Path(args.model) if args.model else None,
            dtype=args.dtype,
        )
    )
    print(
        f"specshim export: {counts['samples']} samples in {args.dest} "
        f"({counts['written']} written, {counts['kept']} already there, each "
        f"checked against its source); layers {counts['source_layers']} are "
        f"{counts['layer_ids']} in speculators >= 0.5's convention. Train with "
        f"{counts['train_with']}"
    )
    for layer, row in zip(counts["layer_ids"], counts["agreement"] or (), strict=False):
        print(
            f"  fp8 vs the extracted states, layer {layer}: mean cosine "
            f"{row['mean_cosine']:.4f} (lowest {row['lowest_cosine']:.4f}), "
            f"mean norm ratio {row['mean_norm_ratio']:.4f}"
        )
    return 0


def _run(args: argparse.Namespace) -> int:
    from specshim._run import refuse_unpatched

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command or not command[0]:
        raise UsageError(
            "specshim run needs a command: specshim run -- python script.py"
        )
    refuse_unpatched(command)  # -S, -E, -I: it would run, unpatched, and exit 0
    bootstrap = str(Path(__file__).with_name("_bootstrap"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [bootstrap] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    # Named in the error of a Python that cannot import specshim.
    env["SPECSHIM_RUN_PYTHON"] = sys.executable
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        raise UsageError(f"command not found: {command[0]}") from None
    except OSError as exc:  # a directory, a file without its execute bit, ...
        hint = ""
        if os.path.isfile(command[0]) and command[0].endswith(".py"):
            hint = f"; run it with Python: specshim run -- python {command[0]}"
        elif os.path.isdir(command[0]):
            hint = "; that is a directory"
        raise UsageError(
            f"cannot run {command[0]}: {exc.strerror or exc}{hint}"
        ) from None
    return 127  # not reached


def build_parser() -> argparse.ArgumentParser:
    """The parser (``specshim._cli_parser``), wired to the commands here.

    ``extract``'s defaults are ``ExtractOptions``' own, read when the parser is
    built so that ``import specshim.cli`` loads nothing of the job.
    """
    import dataclasses

    from specshim._cli_parser import build_parser as _build
    from specshim.job.extract.options import ExtractOptions

    defaults = {
        field.name: field.default
        for field in dataclasses.fields(ExtractOptions)
        if field.default is not dataclasses.MISSING
    }
    handlers = {
        "extract": _extract,
        "verify": _verify,
        "status": _status,
        "export": _export,
        "demo": _demo,
        "run": _run,
        "doctor": _doctor,
        "check": _check,
        "table": _table,
    }
    return _build(handlers, defaults)


def _interrupted(command: str) -> str:
    """One line for a Ctrl-C: a run's files are written whole or not at all
    (extract drains its writer first), so a rerun resumes."""
    if command == "extract":
        return (
            "interrupted: every file written is whole; rerun the same command to resume"
        )
    return "interrupted"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return int(args.func(args))
    except UsageError as exc:
        print(f"specshim {args.name}: error: {exc}", file=sys.stderr)
        return 2
    except InterruptedRunError as exc:
        print(f"specshim {args.name}: {exc}", file=sys.stderr)
        return INTERRUPTED
    except KeyboardInterrupt:
        print(f"specshim {args.name}: {_interrupted(args.name)}", file=sys.stderr)
        return INTERRUPTED
    except SpecShimError as exc:
        print(f"specshim {args.name}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`specshim table | head`): not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
