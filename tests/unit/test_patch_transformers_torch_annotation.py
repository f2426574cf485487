"""The transformers_torch_annotation patch (deps; main and worker)."""

from __future__ import annotations

import pytest
import torch

from specshim._types import NotNeeded


def test_transformers_torch_annotation_only_where_torch_is_type_checking_only(
    monkeypatch,
):
    import sys
    import types

    from specshim._base import TRANSFORMERS_CONFIG
    from specshim.patches.deps import transformers_torch_annotation as patch

    # transformers 4 (this environment) binds no such annotation.
    with pytest.raises(NotNeeded, match="no PretrainedConfig annotation"):
        patch.PATCH.probe(None)
    fake = types.ModuleType(TRANSFORMERS_CONFIG)

    class PretrainedConfig:
        dtype: "str | torch.dtype | None"  # noqa: F821, UP037 - as transformers 5

    fake.PretrainedConfig = PretrainedConfig
    monkeypatch.setitem(sys.modules, TRANSFORMERS_CONFIG, fake)
    patch.PATCH.probe(None)  # needed: torch named, not bound
    assert patch.PATCH.build(None) is torch
    with pytest.raises(NotNeeded, match="binds torch itself"):
        patch.PATCH.probe(torch)
    assert patch.PATCH.process == "main, worker"
    assert patch.PATCH.module == TRANSFORMERS_CONFIG
