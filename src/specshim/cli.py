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

from specshim._base import SpecShimError, UsageError
from specshim._settings import DEFAULT_BATCH_SIZE, KNOBS, STEP_DEFAULTS
from specshim._versions import TESTED_VLLM


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
    from specshim.job.extract import _text_config

    model = Path(args.model)
    _text_config(model, flag)  # a directory with a readable config.json
    if getattr(args, "trust_remote_code", False):
        configure(trust_remote_code=True)
    require_consent(model, flag=True)
    return model


def _data_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--split", help="the split of a dataset that has several (default: train)"
    )
    parser.add_argument(
        "--column",
        help="the field that holds each sample (token ids, text, or chat turns); "
        "default: input_ids, text, messages or conversations",
    )


def _trust_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the Python code the checkpoint ships (its auto_map) to run, "
        "here and in every vLLM worker; a checkpoint with code is refused "
        "without it (also: SPECSHIM_TRUST_REMOTE_CODE=1)",
    )


def _doctor(args: argparse.Namespace) -> int:
    import specshim

    # vLLM logs to stdout; keep stdout for the report itself (valid --json).
    from specshim.compat import TARGET_MODULES

    if args.model:
        _checkpoint(args)
    with _stdout_to_stderr():
        failures = []
        for name in TARGET_MODULES:
            try:
                importlib.import_module(name)
            except SpecShimError as exc:
                failures.append(str(exc))
            except ImportError as exc:
                failures.append(f"cannot import {name}: {exc}")
        data = specshim.report()
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
    from specshim.job.dataset import parse_shard
    from specshim.job.extract import ExtractOptions, extract, parse_layers

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
    )
    with _stdout_to_stderr():
        counts = extract(options)
    print(summary(counts, options.out))
    return 0


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
    from specshim.job.verify import verify, verify_all

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


def _run(args: argparse.Namespace) -> int:
    from specshim._run import refuse_unpatched

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
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
    return 127  # not reached


def _command(
    commands: argparse._SubParsersAction, name: str, summary: str, example: str
) -> argparse.ArgumentParser:
    return commands.add_parser(
        name,
        help=summary,
        description=f"{summary}\n\nexample:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _version() -> str:
    import specshim
    from specshim._versions import installed_version

    parts = [f"specshim {specshim.__version__}"]
    for name in ("speculators", "vllm"):
        parts.append(f"{name} {installed_version(name) or 'not installed'}")
    return ", ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specshim",
        description=(
            "Run speculators 0.3.0's hidden-state generator, unmodified, on newer "
            f"vLLM (tested: {TESTED_VLLM[0]} to {TESTED_VLLM[-1]})."
        ),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="name", required=True, metavar="COMMAND")
    for add in (_add_extract, _add_verify, _add_status, _add_tools):
        add(commands)
    return parser


def _add_extract(commands: argparse._SubParsersAction) -> None:
    extract = _command(
        commands,
        "extract",
        "Write speculators training files (data_{i}.pt) for a JSONL dataset. "
        "Resumable (rerun the same command), shardable (--shard I/N).",
        "specshim extract --model /models/Kimi-K2.5 --trust-remote-code "
        "--data chats.jsonl --out hs/ --tp 8 --layers 2,30,58,60",
    )
    extract.add_argument("--model", required=True, help="a local checkpoint directory")
    extract.add_argument(
        "--data",
        required=True,
        help="JSONL, a JSON array (either also gzip/bzip2/xz-compressed), Parquet, "
        "Arrow, or a datasets directory "
        "(save_to_disk); each sample has input_ids, text, or "
        "messages/conversations (ShareGPT from/value turns too)",
    )
    extract.add_argument("--out", required=True, help="output directory")
    extract.add_argument(
        "--layers",
        help="comma-separated decoder layer ids (default: speculators' choice)",
    )
    extract.add_argument(
        "--max-model-len",
        type=int,
        default=2048,
        help="longer samples are truncated to max-model-len - 1 tokens, with a "
        "warning that counts them (speculators' behaviour)",
    )
    extract.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    extract.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help="samples per generate() call (default %(default)s; their captured "
        "states are held in accelerator memory until the call returns)",
    )
    for knob in KNOBS:  # the step budget: flag > environment > extract's default
        extract.add_argument(
            knob.flag,
            type=knob.kind,
            help=f"{knob.meaning} (speculators: {knob.speculators}; default "
            f"{STEP_DEFAULTS[knob.name]}, or {knob.env})",
        )
    extract.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    extract.add_argument(
        "--move-orphans",
        action="store_true",
        help="move files of samples the dataset no longer has (a rerun on a "
        "shorter dataset) to OUT/.specshim/orphans/ instead of stopping with an "
        "error: speculators' trainer reads every .pt in OUT",
    )
    extract.add_argument(
        "--cpu-kv-space-gib",
        type=int,
        help="on a host without an accelerator: vLLM's KV-cache space in GiB "
        "(default: VLLM_CPU_KVCACHE_SPACE if set, else what the job needs, at "
        "most half the available memory)",
    )
    extract.add_argument(
        "--shard",
        help="I/N: take samples i with i %% N == I; auto: the index and count of "
        "a SLURM job array or a Kubernetes indexed Job (SPECSHIM_SHARD_COUNT)",
    )
    _data_flags(extract)
    _trust_flag(extract)
    extract.set_defaults(func=_extract)


def _add_verify(commands: argparse._SubParsersAction) -> None:
    verify = _command(
        commands,
        "verify",
        "Recompute written samples (a bounded Hugging Face forward, or each "
        "sample alone through the generator) and report per-layer agreement; "
        "--all checks every file against the dataset. Non-zero exit on any "
        "disagreement.",
        "specshim verify --model /models/tiny --out hs/ --samples 8 --reference auto",
    )
    verify.add_argument("--model", required=True)
    verify.add_argument("--out", required=True, help="a directory written by extract")
    verify.add_argument(
        "--samples",
        type=int,
        help="how many samples to recompute with HF (default 8; with --all: none)",
    )
    verify.add_argument(
        "--all",
        action="store_true",
        help="load every file, check its tokens against --data and its shapes "
        "against the run's settings; name each bad or missing file",
    )
    verify.add_argument("--data", help="the dataset extract read (for --all)")
    _data_flags(verify)
    verify.add_argument(
        "--reference",
        choices=("auto", "hf", "solo"),
        default="auto",
        help="recompute with a Hugging Face forward of the layers up to the "
        "deepest captured one (hf), or each sample alone through the run's own "
        "generator (solo, any model and TP size); auto: hf if it fits in memory",
    )
    verify.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel size for --reference solo (default: the run's)",
    )
    verify.add_argument("--seed", type=int, default=0, help="which samples to pick")
    _trust_flag(verify)
    verify.set_defaults(func=_verify)


def _add_status(commands: argparse._SubParsersAction) -> None:
    status = _command(
        commands,
        "status",
        "Show how far an extract output directory has got: samples and tokens "
        "done and missing, per shard, bytes, each run's pace and the ETA. Loads "
        "no model and reads no output file; exits 1 until the set is complete.",
        "specshim status --out hs/ --data chats.jsonl",
    )
    status.add_argument("--out", required=True, help="a directory written by extract")
    status.add_argument("--data", help="the dataset (to count what is missing)")
    _data_flags(status)
    status.set_defaults(func=_status)


def _add_tools(commands: argparse._SubParsersAction) -> None:
    """demo, run, doctor, check and table."""
    demo = _command(
        commands,
        "demo",
        "Build a tiny DeepSeek-V3-style MoE (cached), run speculators' unmodified "
        "generator on vLLM's CPU backend, and check every layer against HF.",
        "specshim demo",
    )
    demo.add_argument(
        "--cache", help="where to keep the tiny model (~/.cache/specshim)"
    )
    demo.set_defaults(func=_demo)

    run = _command(
        commands,
        "run",
        "Run a program with specshim active in it and in its Python children, "
        "without editing it.",
        "specshim run -- python scripts/data_generation_offline.py "
        "--target-model-path ...",
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    run.set_defaults(func=_run)

    doctor = _command(
        commands,
        "doctor",
        "Show versions, the worker plugin, and every patch's state.",
        "specshim doctor",
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument(
        "--model",
        metavar="PATH",
        help="also show how the generator will load this checkpoint",
    )
    _trust_flag(doctor)
    doctor.set_defaults(func=_doctor)

    check = _command(
        commands,
        "check",
        "Vet the installed vLLM/speculators: every patch target, probe and "
        "expected state (exit 1 on drift). Run it in CI before a GPU job.",
        "specshim check",
    )
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(func=_check)

    table = _command(
        commands,
        "table",
        "Print the patch table (markdown) generated from the patch files; "
        "--write updates the generated tables in README.md and docs/drift.md.",
        "specshim table --write README.md --write docs/drift.md",
    )
    table.add_argument(
        "--write",
        metavar="FILE",
        action="append",
        help="update the generated tables in this file (README.md, docs/drift.md); "
        "repeatable",
    )
    table.add_argument(
        "--drift", action="store_true", help="print the drift table instead"
    )
    table.set_defaults(func=_table)


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
