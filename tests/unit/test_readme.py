"""The README and the docs pages say what the code does: the generated tables
are the registry's and the matrix's, not hand-written copies; the README stays
a short front door whose commands, files and figures exist; docs/usage.md
documents every option the parser has, with its default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specshim._table import render_into

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
HOW_IT_WORKS = ROOT / "docs" / "how-it-works.md"
COMPATIBILITY = ROOT / "docs" / "compatibility.md"
USAGE = ROOT / "docs" / "usage.md"

# The front door, in this order; everything else lives in docs/.
README_SECTIONS = [
    "Try it",
    "Install on a GPU machine",
    "Commands",
    "Compatibility",
    "Performance",
    "Documentation",
    "Licence",
]


def _sections(text: str, level: str = "##") -> dict[str, str]:
    """Each ``level`` heading's title and the text under it."""
    parts = re.split(rf"^{level} (.+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^```\w*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def test_readme_is_a_short_front_door():
    text = README.read_text()
    assert len(text.encode()) <= 15_000, "move detail to a page under docs/"
    assert list(_sections(text)) == README_SECTIONS


def test_readme_make_commands_are_makefile_targets():
    targets = set(
        re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
    )
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    named = {
        (page.name, target)
        for page in pages
        for block in _code_blocks(page.read_text())
        for target in re.findall(r"^make ([\w-]+)", block, flags=re.MULTILINE)
    }
    assert {"demo", "test"} <= {target for _, target in named}
    assert [n for n in sorted(named) if n[1] not in targets] == []


def test_install_lines_name_files_that_exist():
    """`pip install . -r FILE` runs in the checkout: FILE must be there, and
    `.` is the checkout that tests/unit/test_install.py builds and installs."""
    lines = [
        line
        for page in [README, ROOT / "docs" / "gpu.md"]
        for block in _code_blocks(page.read_text())
        for line in block.splitlines()
        if line.startswith("pip install")
    ]
    assert lines, "the README gives no install line"
    for line in lines:
        assert line.split()[2] == ".", line  # no index serves specshim
        for name in re.findall(r"-r (\S+)", line):
            assert (ROOT / name).is_file(), line


def test_readme_commands_table_names_every_command():
    from specshim.cli import build_parser

    commands = _sections(README.read_text())["Commands"]
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if a.choices and a.dest == "name"]
    missing = [n for n in subparsers.choices if f"`specshim {n}" not in commands]
    assert missing == [], "name them in the README's Commands section"


def test_readme_gpu_figures_are_the_committed_bench_gpu_results():
    """The headline table's rates and its extract ÷ native ratios, each from
    benchmarks/results/gpu.md (a table cell or a note's figure), and each row's
    ratio its own extract over its own native."""
    performance = _sections(README.read_text())["Performance"]
    results = (ROOT / "benchmarks" / "results" / "gpu.md").read_text()
    said = set(re.findall(r"[\d,]*\d(?:\.\d+)?", results))
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in performance.splitlines()
        if line.startswith("| ") and not line.startswith("| model")
    ]
    assert len(rows) == 4 and all(len(row) == 6 for row in rows)
    for model, prefill, native, generate, extract, ratio in rows:
        figures = [prefill, generate, extract] + [native, ratio] * native[0].isdigit()
        assert [f for f in figures if f not in said] == [], model
        if native[0].isdigit():
            rate = int(extract.replace(",", "")) / int(native.replace(",", ""))
            assert round(rate, 4) == float(ratio), model


def _usage_rows(section: str) -> dict[str, str]:
    """The options table of a usage.md section: each flag and its default."""
    rows = {}
    for line in section.splitlines():
        match = re.match(r"^\| `(-[-\w]+)[^`]*`(?: or `[^`]*`)? \| ([^|]+) \|", line)
        if match:
            rows[match.group(1)] = match.group(2).strip()
    return rows


def _subcommands():
    from specshim.cli import build_parser

    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if a.choices and a.dest == "name"]
    return subparsers.choices


@pytest.mark.parametrize("name", list(_subcommands()))
def test_usage_documents_every_option_and_its_default(name):
    import argparse

    from specshim._settings import KNOBS, STEP_DEFAULTS

    section = _sections(USAGE.read_text()).get(name)
    assert section is not None, f"docs/usage.md has no '## {name}' section"
    rows = _usage_rows(section)
    knobs = {knob.flag: STEP_DEFAULTS[knob.name] for knob in KNOBS}
    for action in _subcommands()[name]._actions:
        flags = [f for f in action.option_strings if f.startswith("--")]
        if not flags or isinstance(action, argparse._HelpAction):
            continue
        flag = flags[0]
        assert flag in rows, f"docs/usage.md, ## {name}: no row for {flag}"
        default = knobs.get(flag, action.default)
        if default is not None and default is not False:  # 0 is a default
            assert rows[flag].startswith(str(default)), (
                f"docs/usage.md, ## {name}: {flag} defaults to {default}"
            )


def test_patch_table_is_generated_and_current():
    text = HOW_IT_WORKS.read_text()
    assert render_into(text, "docs/how-it-works.md") == text, (
        "run: python -m specshim table --write docs/how-it-works.md"
    )


def _matrix_module():
    import importlib.util

    path = ROOT / "matrix" / "run.py"
    spec = importlib.util.spec_from_file_location("specshim_matrix_run", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compat_table_covers_every_version_and_patch():
    """The matrix wrote it; a patch added since then needs a new matrix run."""
    import specshim

    matrix = _matrix_module()
    table = matrix._table_states(COMPATIBILITY.read_text())
    assert list(table) == list(matrix.VERSIONS)
    ids = [patch.id for patch in specshim.registry()]
    for version, states in table.items():
        assert list(states) == ids, f"vLLM {version}: rerun make test-matrix"
        assert set(states.values()) <= {"applied", "not needed"}, version


def test_compat_table_round_trips():
    matrix = _matrix_module()
    results = [
        {
            "version": "0.11.0",
            "states": {"a": "applied", "b": "not needed"},
            "contract": "3 passed",
            "e2e": "14 passed",
        },
        {
            "version": "0.16.0",
            "states": {"a": "applied", "b": "applied"},
            "contract": "3 passed",
            "e2e": "21 passed",
        },
    ]
    text = f"x\n{matrix.TABLE.begin}\n\n{matrix.TABLE.end}\ny"
    text = matrix.TABLE.render(text, matrix.compat_table(results))
    assert matrix._table_states(text) == {r["version"]: r["states"] for r in results}


def test_compat_column_of_the_installed_release_is_what_doctor_says():
    """The release `make test` runs on (CI's matrix step checks the oldest and
    newest): its column is what `specshim doctor` finds here, as the matrix
    records it."""
    import json
    import os
    import subprocess
    import sys

    from specshim._versions import installed_version

    matrix = _matrix_module()
    version = installed_version("vllm").split("+")[0]
    column = matrix._table_states(COMPATIBILITY.read_text()).get(version)
    assert column is not None, f"vLLM {version} is not in the compatibility table"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    env.pop("SPECSHIM_DISABLE", None)
    doctor = subprocess.run(
        [sys.executable, "-m", "specshim", "doctor", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    states = {p["id"]: p["state"] for p in json.loads(doctor.stdout)["patches"]}
    assert states == column, "docs/compatibility.md's table disagrees with doctor"
