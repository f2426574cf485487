"""The ``vllm.general_plugins`` entry point.

vLLM calls ``load_general_plugins()`` in every process it starts, workers
included, before it resolves ``worker_extension_cls``; so importing specshim
here arms the worker patches before speculators' extension module is imported.
"""

from __future__ import annotations


def register() -> None:
    import specshim

    specshim.apply()
