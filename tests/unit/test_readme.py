"""The README's patch table is the registry's, not a hand-written copy."""

from __future__ import annotations

from pathlib import Path

from specshim._table import render_into

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_patch_table_is_generated_and_current():
    text = README.read_text()
    assert render_into(text) == text, "run: python -m specshim table --write README.md"
