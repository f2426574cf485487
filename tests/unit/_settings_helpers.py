"""What the settings tests share: the ``generator_module`` fixture
(speculators' generator module, its settings reset afterwards; defined under
another name so that the tests importing it do not shadow it) and a fresh
Python process without SPECSHIM_* variables."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

import specshim
from specshim._base import GENERATOR


@pytest.fixture(name="generator_module")
def _generator_module():
    module = importlib.import_module(GENERATOR)
    yield module
    specshim.configure(reset=True)


def _fresh_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SPECSHIM_")}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full
    )
