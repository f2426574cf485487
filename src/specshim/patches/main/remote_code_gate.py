"""No checkpoint code runs unless the user consented.

Why:
    speculators' generator passes ``trust_remote_code=True`` to ``AutoConfig``
    and to vLLM's ``ModelConfig`` (which hands it to every worker), so a
    checkpoint whose configs name Python files in an ``auto_map`` runs that code
    in the main process and in every vLLM worker, unasked. vLLM, transformers
    and every tool around them refuse such code unless told otherwise. The
    generator's constructor now first looks at the checkpoint: if it ships
    code and the user has not consented (``specshim.configure(
    trust_remote_code=True)``, ``SPECSHIM_TRUST_REMOTE_CODE=1``, or the command
    line's ``--trust-remote-code``), it raises ``SpecShimError`` naming the
    files, before anything is loaded. With consent, or for a checkpoint without
    code, speculators runs as written. A model given by hub id is checked
    through the ``config.json`` and ``tokenizer_config.json`` transformers
    fetches for it. Being the first thing the constructor runs, it also
    refuses a step budget from a bad ``SPECSHIM_*`` value (kept, not raised,
    at import), which speculators would otherwise replace by its own.
Upstream change:
    None: speculators 0.3.0 hard-codes ``trust_remote_code=True``.
Upstream PR:
    none: not an upstream change.
Remove when:
    speculators takes ``trust_remote_code`` from its caller.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from specshim._remote_code import require_consent
from specshim._settings import require_valid_environment
from specshim._types import Incompatible
from specshim.patches._declare import declare
from specshim.patches._wrappers import parameters


def _local(model_path: str) -> Path | str:
    """The checkpoint as a directory; a hub id is resolved to its cached configs."""
    if Path(model_path).is_dir():
        return model_path
    try:
        from transformers.utils import cached_file

        config = cached_file(model_path, "config.json")
        cached_file(
            model_path,
            "tokenizer_config.json",
            _raise_exceptions_for_missing_entries=False,
        )
    except Exception:  # noqa: BLE001 - speculators' own loader reports it
        return model_path
    return str(Path(config).parent) if config else model_path


def _build(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, model_path: str, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        # speculators reads the step-budget constants below: a bad SPECSHIM_*
        # value stops it here rather than leave speculators' own in place.
        require_valid_environment()
        require_consent(_local(str(model_path)))
        original(self, model_path, *args, **kwargs)

    __init__.__specshim__ = True  # type: ignore[attr-defined]
    return __init__


def _probe(original: Any) -> None:
    if "model_path" not in parameters(original):
        raise Incompatible(
            "VllmHiddenStatesGenerator.__init__(model_path, ...)", "no model_path"
        )


PATCH = declare(
    __name__,
    __doc__,
    id="remote-code-gate",
    attribute="VllmHiddenStatesGenerator.__init__",
    versions=">=0.11",
    probe=_probe,
    build=_build,
)
