"""The README and the docs pages say what the code does: the generated tables
are the registry's and the matrix's, not hand-written copies."""

from __future__ import annotations

from pathlib import Path

from specshim._table import render_into

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
HOW_IT_WORKS = ROOT / "docs" / "how-it-works.md"
COMPATIBILITY = ROOT / "docs" / "compatibility.md"


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
