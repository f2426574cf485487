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
Upstream PR:
    none: not an upstream change.
Remove when:
    speculators takes ``trust_remote_code`` from its caller.
"""

from __future__ import annotations

from typing import Any

import wrapt

from specshim._settings import trust_remote_code
from specshim._types import Incompatible
from specshim.patches._declare import declare


class _ConsentingTokenizer(wrapt.ObjectProxy):  # type: ignore[misc]
    __specshim__ = True  # upstream() sees through it

    def from_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["trust_remote_code"] = trust_remote_code()
        return self.__wrapped__.from_pretrained(*args, **kwargs)


def _probe(original: Any) -> None:
    if not callable(getattr(original, "from_pretrained", None)):
        raise Incompatible("AutoTokenizer.from_pretrained", repr(original))


PATCH = declare(
    __name__,
    __doc__,
    id="remote-code-tokenizer",
    attribute="AutoTokenizer",
    versions=">=0.11",
    probe=_probe,
    build=_ConsentingTokenizer,
)
