"""transformers' ``torch`` annotation made resolvable, so speculators imports.

Why:
    speculators 0.3.0's ``SpeculatorModelConfig`` is a pydantic model that also
    inherits transformers' ``PretrainedConfig``. transformers 5 annotates
    ``PretrainedConfig.dtype`` as ``Union[str, "torch.dtype"] | None`` and
    imports ``torch`` in ``configuration_utils`` only for type checking. When
    ``import speculators`` builds its configs, pydantic evaluates that
    annotation in the module's namespace and fails: "PydanticUndefinedAnnotation:
    name 'torch' is not defined". vLLM 0.24 and later require transformers 5, so
    without this speculators 0.3.0 cannot be imported at all, in the main
    process or in a worker. The patch binds ``torch`` in
    ``transformers.configuration_utils``, the name the annotation means;
    nothing else of transformers changes. It must apply before speculators is
    imported: ``import specshim``, the vLLM plugin and ``specshim run`` all arm
    it before that.
Upstream change:
    transformers 5.4: ``PretrainedConfig.dtype`` annotated with ``"torch.dtype"``
    while ``torch`` is imported only under ``TYPE_CHECKING`` (5.5.3 is the
    oldest release vLLM 0.24 accepts); vLLM 0.24: transformers >= 5.5.3.
Upstream PR:
    not found.
Remove when:
    speculators resolves its config annotations itself, or transformers
    imports ``torch`` where it annotates with it.
"""

from __future__ import annotations

import importlib
from typing import Any

from specshim._base import TRANSFORMERS_CONFIG
from specshim._types import Incompatible, NotNeeded
from specshim.patches._declare import declare


def _probe(original: Any) -> None:
    if original is not None:
        raise NotNeeded("transformers' config module binds torch itself")
    module = importlib.import_module(TRANSFORMERS_CONFIG)  # loaded: the hook fired
    config = getattr(module, "PretrainedConfig", None)
    if config is None:
        raise Incompatible("transformers.configuration_utils.PretrainedConfig", "none")
    annotations = getattr(config, "__annotations__", {})
    if not any("torch" in str(value) for value in annotations.values()):
        raise NotNeeded("no PretrainedConfig annotation names torch")


def _torch(original: Any) -> Any:
    import torch

    return torch


PATCH = declare(
    __name__,
    __doc__,
    id="transformers-torch-annotation",
    module=TRANSFORMERS_CONFIG,
    attribute="torch",
    package="transformers",
    versions=">=5.4",
    probe=_probe,
    build=_torch,
    drift_rows=(19,),
)
