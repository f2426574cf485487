"""``pytest --pyargs specshim.compat``: the same checks as ``specshim check``."""

from __future__ import annotations

import pytest

from specshim.compat import run_checks

CHECKS = run_checks()


@pytest.mark.parametrize("check", CHECKS, ids=[check.name for check in CHECKS])
def test_compat(check):
    assert check.ok, check.detail
