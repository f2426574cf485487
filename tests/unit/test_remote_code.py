"""Checkpoint code runs only with the user's consent."""

from __future__ import annotations

import json

import pytest

import specshim
from specshim import SpecShimError, _remote_code
from specshim._base import UsageError


@pytest.fixture(autouse=True)
def _no_consent(monkeypatch):
    monkeypatch.delenv("SPECSHIM_TRUST_REMOTE_CODE", raising=False)
    specshim.configure(reset=True)  # no consent given, none from the env
    yield
    specshim.configure(reset=True)


def _checkpoint(tmp_path, config_map=None, tokenizer_map=None):
    config = {"model_type": "x"}
    if config_map:
        config["auto_map"] = config_map
    (tmp_path / "config.json").write_text(json.dumps(config))
    if tokenizer_map is not None:
        tok = {"tokenizer_class": "MyTokenizer", "auto_map": tokenizer_map}
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok))
    return tmp_path


def test_code_files_names_every_auto_map_reference(tmp_path):
    model = _checkpoint(
        tmp_path,
        {"AutoConfig": "configuration_x.XConfig", "AutoModel": "other--modeling_x.X"},
        {"AutoTokenizer": ["tokenization_x.XTokenizer", None]},
    )
    assert _remote_code.code_files(model) == [
        "configuration_x.py (from config.json)",
        "other--modeling_x (from config.json)",
        "tokenization_x.py (from tokenizer_config.json)",
    ]


def test_a_checkpoint_without_code_needs_no_consent(tmp_path):
    assert _remote_code.require_consent(_checkpoint(tmp_path)) is False


def test_unreadable_config_counts_as_code(tmp_path):
    _checkpoint(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    assert _remote_code.code_files(tmp_path) == [
        "tokenizer_config.json (unreadable) (from tokenizer_config.json)"
    ]


def test_code_is_refused_then_consented(tmp_path, monkeypatch):
    model = _checkpoint(tmp_path, {"AutoConfig": "configuration_x.XConfig"})
    with pytest.raises(SpecShimError, match=r"configuration_x\.py.*configure\("):
        _remote_code.require_consent(model)
    with pytest.raises(UsageError, match="pass --trust-remote-code"):
        _remote_code.require_consent(model, flag=True)
    monkeypatch.setenv("SPECSHIM_TRUST_REMOTE_CODE", "1")
    assert _remote_code.require_consent(model) is True
    specshim.configure(trust_remote_code=False)  # configure() wins over the env
    with pytest.raises(SpecShimError):
        _remote_code.require_consent(model)
    specshim.configure(trust_remote_code=True)
    assert _remote_code.require_consent(model) is True


def test_consent_must_be_a_bool():
    with pytest.raises(SpecShimError, match="True or False"):
        specshim.configure(trust_remote_code="yes")
