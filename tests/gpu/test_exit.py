"""On a GPU too, a process that never closes its generator ends at once and
quietly: a plain script, and a pytest run with a failing test. The cases are
``tests/e2e/test_exit.py``'s own functions."""

from __future__ import annotations

from ..e2e.test_exit import (  # noqa: F401 - collected here
    test_a_pytest_run_with_a_failing_test_exits_after_its_summary,
    test_a_script_that_never_closes_its_generator_exits_quietly,
)
