"""The ``vllm.general_plugins`` entry point (a package of its own).

vLLM calls ``load_general_plugins()`` in every process it starts, workers
included, before it resolves ``worker_extension_cls``; so importing specshim
here arms the worker patches before speculators' extension module is imported.

In a vLLM process that never imports speculators this only arms import hooks
for the three hooked modules (speculators' two, transformers' config module):
no patch of speculators applies and nothing of vLLM changes.
``SPECSHIM_DISABLE=all`` turns even that off: the plugin then imports nothing
(which is why it lives outside ``specshim``, whose import arms the hooks).
"""

from __future__ import annotations

import os


def register() -> None:
    disabled = os.environ.get("SPECSHIM_DISABLE", "")
    if "all" in {item.strip() for item in disabled.split(",")}:
        return
    import specshim

    specshim.apply()
