"""The argument parser of the ``specshim`` command line (``specshim.cli``).

Only the parser: the commands it dispatches to, and the defaults of
``extract``'s flags (``ExtractOptions``' own, in the job wing), are handed in
by ``specshim.cli``, so this module imports nothing of the job.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from specshim._settings import GPU_STEP_DEFAULTS, KNOBS, STEP_DEFAULTS
from specshim._versions import TESTED_VLLM

Handler = Callable[[argparse.Namespace], int]


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


class _Parser(argparse.ArgumentParser):
    """Errors in one line, as every other error of the CLI: what is wrong, and
    where the usage is (argparse prints its usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(
    handlers: Mapping[str, Handler], extract_defaults: Mapping[str, Any]
) -> argparse.ArgumentParser:
    """The parser; ``handlers`` maps each command to the function that runs it,
    ``extract_defaults`` gives ``extract``'s defaults (``ExtractOptions``')."""
    parser = _Parser(
        prog="specshim",
        description=(
            "Run speculators 0.3.0's hidden-state generator, unmodified, on newer "
            f"vLLM (tested: {TESTED_VLLM[0]} to {TESTED_VLLM[-1]})."
        ),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="name", required=True, metavar="COMMAND")
    _add_extract(commands, handlers["extract"], extract_defaults)
    for add in (
        _add_verify,
        _add_status,
        _add_export,
        _add_demo,
        _add_run,
        _add_doctor,
        _add_check,
        _add_table,
    ):
        add(commands, handlers)
    return parser


def _add_extract(
    commands: argparse._SubParsersAction,
    handler: Handler,
    defaults: Mapping[str, Any],
) -> None:
    extract = _command(
        commands,
        "extract",
        "Write speculators training files (data_{i}.pt) for a JSONL dataset. "
        "Resumable (rerun the same command), shardable (--shard I/N).",
        "specshim extract --model /models/Kimi-K2.5 --trust-remote-code "
        "--data chats.jsonl --out hs/ --tp 8 --layers 2,30,58,60",
    )
    _extract_input_flags(extract)
    _extract_engine_flags(extract, defaults)
    _extract_run_flags(extract)
    _data_flags(extract)
    _trust_flag(extract)
    extract.set_defaults(func=handler)


def _extract_input_flags(extract: argparse.ArgumentParser) -> None:
    """--model, --data, --out and --layers: what is read, where it goes."""
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


def _extract_engine_flags(
    extract: argparse.ArgumentParser, defaults: Mapping[str, Any]
) -> None:
    """The engine's size and step budget, up to --gpu-memory-utilization."""
    extract.add_argument(
        "--max-model-len",
        type=int,
        default=defaults["max_model_len"],
        help="longer samples are truncated to max-model-len - 1 tokens, with a "
        "warning that counts them (speculators' behaviour)",
    )
    extract.add_argument(
        "--tp", type=int, default=defaults["tp"], help="tensor-parallel size"
    )
    extract.add_argument(
        "--batch-size",
        type=int,
        default=defaults["batch_size"],
        help="samples per generate() call (default %(default)s; their captured "
        "states are held in accelerator memory until the call returns)",
    )
    for knob in KNOBS:  # the step budget: flag > environment > extract's default
        extract.add_argument(
            knob.flag,
            type=knob.kind,
            help=f"{knob.meaning} (speculators: {knob.speculators}; default "
            f"{STEP_DEFAULTS[knob.name]}{_on_a_gpu(knob.name)}, or {knob.env})",
        )
    extract.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=defaults["gpu_memory_utilization"],
    )


def _extract_run_flags(extract: argparse.ArgumentParser) -> None:
    """--move-orphans, --cpu-kv-space-gib, --reuse-prefixes, --reuse-cap-mib,
    --shard and --data-parallel."""
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
    reuse = "compute prefixes samples share once, cached rows put back (docs/usage.md)"
    extract.add_argument("--reuse-prefixes", action="store_true", help=reuse)
    cap = "with --reuse-prefixes: MiB of prefix rows held (default: the plan's)"
    extract.add_argument("--reuse-cap-mib", type=int, help=cap)
    extract.add_argument(
        "--shard",
        help="I/N: take samples i with i %% N == I; auto: the index and count of "
        "a SLURM job array or a Kubernetes indexed Job (SPECSHIM_SHARD_COUNT)",
    )
    extract.add_argument(
        "--data-parallel",
        "--dp",
        type=int,
        metavar="N",
        help="run N shards of this command on this host at once, shard I on "
        "GPUs I*TP to I*TP+TP-1 of those visible; one progress line, one exit "
        "status, each shard's log in OUT/.specshim/ (with --shard auto: N "
        "shards of this host's)",
    )


def _add_verify(
    commands: argparse._SubParsersAction, handlers: Mapping[str, Handler]
) -> None:
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
    verify.set_defaults(func=handlers["verify"])


def _add_status(
    commands: argparse._SubParsersAction, handlers: Mapping[str, Handler]
) -> None:
    status = _command(
        commands,
        "status",
        "Show how far an extract output directory has got: samples done and "
        "missing, tokens done, samples per shard, bytes, each run's pace and the "
        "ETA. Loads "
        "no model and reads no output file; exits 1 until the set is complete.",
        "specshim status --out hs/ --data chats.jsonl",
    )
    status.add_argument("--out", required=True, help="a directory written by extract")
    status.add_argument("--data", help="the dataset (to count what is missing)")
    _data_flags(status)
    status.set_defaults(func=handlers["status"])


def _add_export(
    commands: argparse._SubParsersAction, handlers: Mapping[str, Handler]
) -> None:
    export = _command(
        commands,
        "export",
        "Write a complete extract output in the layout today's speculators "
        "trains from (an Arrow dataset and hidden_states/hs_{i}.safetensors, "
        "layer ids mapped to its convention), checking every sample against "
        "its source. Reruns resume; specshim_export.json, written last, says "
        "how to train on it.",
        "specshim export --out hs/ --to speculators hs-new/",
    )
    export.add_argument("--out", required=True, help="a directory written by extract")
    export.add_argument(
        "--to", required=True, choices=["speculators"], help="the trainer's layout"
    )
    export.add_argument("dest", help="the directory to write (new, or an export)")
    export.add_argument(
        "--model", help="the model directory (default: the one data_config.json names)"
    )
    export.add_argument(
        "--dtype",
        default="source",
        choices=["source", "bfloat16", "float32", "fp8"],
        help="dtype of the stored states (default: as extracted); fp8: float8 "
        "with a scale per token, read by speculators' fp8 hidden-states backend, "
        "its agreement with the source reported",
    )
    export.set_defaults(func=handlers["export"])


def _add_demo(
    commands: argparse._SubParsersAction, handlers: Mapping[str, Handler]
) -> None:
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
    demo.set_defaults(func=handlers["demo"])


def _add_run(
    commands: argparse._SubParsersAction, handlers: Mapping[str, Handler]
) -> None:
    run = _command(
        commands,
        "run",
        "Run a program with specshim active in it and in its Python children, "
        "without editing it.",
        "specshim run -- python scripts/data_generation_offline.py "
        "--target-model-path ...",
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    run.set_defaults(func=handlers["run"])


def _add_doctor(
    commands: argparse._SubParsersAction, handlers: Mapping[str, Handler]
) -> None:
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
    doctor.set_defaults(func=handlers["doctor"])


def _add_check(
    commands: argparse._SubParsersAction, handlers: Mapping[str, Handler]
) -> None:
    check = _command(
        commands,
        "check",
        "Vet the installed vLLM/speculators: every patch target, probe and "
        "expected state (exit 1 on drift). Run it in CI before a GPU job.",
        "specshim check",
    )
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(func=handlers["check"])


def _add_table(
    commands: argparse._SubParsersAction, handlers: Mapping[str, Handler]
) -> None:
    table = _command(
        commands,
        "table",
        "Print the patch table (markdown) generated from the patch files; "
        "--write updates the generated tables in docs/how-it-works.md and "
        "docs/drift.md.",
        "specshim table --write docs/how-it-works.md --write docs/drift.md",
    )
    table.add_argument(
        "--write",
        metavar="FILE",
        action="append",
        help="update the generated tables in this file (docs/how-it-works.md, "
        "docs/drift.md); repeatable",
    )
    table.add_argument(
        "--drift", action="store_true", help="print the drift table instead"
    )
    table.set_defaults(func=handlers["table"])


def _on_a_gpu(name: str) -> str:
    value = GPU_STEP_DEFAULTS.get(name)
    return "" if value is None else f" ({value} on a GPU)"
