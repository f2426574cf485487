"""Every patch file explains itself: Why / Upstream change / Remove when."""

from __future__ import annotations

import pytest

import specshim
from specshim import patches

PATCH_FILES = [f"specshim.patches.main.{n}" for n in patches.MAIN] + [
    f"specshim.patches.worker.{n}" for n in patches.WORKER
]


@pytest.mark.parametrize("module_name", PATCH_FILES)
def test_patch_file_has_the_three_headings(module_name):
    import importlib

    doc = importlib.import_module(module_name).__doc__ or ""
    for heading in ("Why:", "Upstream change:", "Remove when:"):
        assert f"\n{heading}\n" in doc, f"{module_name} lacks {heading!r}"


def test_every_patch_file_registers_one_patch():
    ids = [p.id for p in specshim.registry()]
    assert len(ids) == len(PATCH_FILES) == len(set(ids))


def test_every_drift_row_is_covered():
    rows = {row for p in specshim.registry() for row in p.drift_rows}
    assert rows == set(range(1, 15))
