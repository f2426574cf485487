"""Weights vLLM draws itself (``load_format="dummy"``) for bench-gpu's models in
``gpu_models.DUMMY_WEIGHTS``, whose checkpoint folder holds no weights.

``install()`` makes speculators' generator load that way in this process
(its ``LoadConfig()`` takes the format; the workers get the config from here).
Run as a script, it is ``specshim`` with that installed:

    python benchmarks/dummy_weights.py extract --model ... --out ...
"""

from __future__ import annotations

import functools
import sys


def install() -> None:
    import importlib

    import specshim  # noqa: F401  (first: it arms the patches speculators needs)

    module = importlib.import_module(
        "speculators.data_generation.vllm_hidden_states_generator"
    )

    if not isinstance(module.LoadConfig, functools.partial):
        module.LoadConfig = functools.partial(module.LoadConfig, load_format="dummy")


def main(argv: list[str]) -> int:
    install()
    from specshim.cli import main as specshim_main

    return specshim_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
