"""The randomized caller of ``generate()`` (``tests/e2e/lifetime.py``) on the
GPU: slabs pinned for the copy engine, the fallback and the pickled path,
replies over the queue's chunk, closing and reopening, every held tensor
checked against what it held at return."""

from __future__ import annotations

from specshim.testing.tiny_models import WIDE_LAYERS

from ..e2e.conftest import make_generator
from ..e2e.test_state_lifetime import run_lifetime


def test_what_generate_returns_stays_the_callers_on_the_gpu(tiny_model_dir):
    path = str(tiny_model_dir("llama_wide"))
    run_lifetime(lambda: make_generator(path, 1, layer_ids=WIDE_LAYERS))
