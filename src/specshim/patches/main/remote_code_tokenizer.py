"""speculators' tokenizer honours the user's consent to checkpoint code.

Why:
    speculators' generator loads the tokenizer with
    ``AutoTokenizer.from_pretrained(model_path)`` and no
    ``trust_remote_code``. A checkpoint whose tokenizer is its own Python class
    (Kimi-K2.5's, named in ``tokenizer_config.json``'s ``auto_map``) then makes
    transformers stop with "contains custom code which must be executed",
    even where the user has consented, so the generator cannot be built for
    it. speculators' module sees an ``AutoTokenizer`` whose ``from_pretrained``
    passes the consent (``specshim.configure(trust_remote_code=...)`` or
    ``SPECSHIM_TRUST_REMOTE_CODE``); ``remote-code-gate`` has already refused
    such a checkpoint without it. Everything else is the real class.
Upstream change:
    None: speculators 0.3.0 never passes ``trust_remote_code`` to its tokenizer.
Remove when:
    speculators takes ``trust_remote_code`` from its caller.
"""

from __future__ import annotations

from typing import Any

import wrapt

from specshim._registry import Incompatible, Patch, register
from specshim._settings import trust_remote_code
from specshim.patches._util import GENERATOR


class _ConsentingTokenizer(wrapt.ObjectProxy):  # type: ignore[misc]
    def from_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["trust_remote_code"] = trust_remote_code()
        return self.__wrapped__.from_pretrained(*args, **kwargs)


def _probe(original: Any) -> None:
    if not callable(getattr(original, "from_pretrained", None)):
        raise Incompatible("AutoTokenizer.from_pretrained", repr(original))


PATCH = register(
    Patch(
        id="remote-code-tokenizer",
        process="main",
        module=GENERATOR,
        attribute="AutoTokenizer",
        package="vllm",
        versions=">=0.11",
        probe=_probe,
        build=_ConsentingTokenizer,
        why=__doc__ or "",
        upstream="none: speculators loads its tokenizer without trust_remote_code",
        remove_when="speculators takes trust_remote_code from its caller",
    )
)
