"""extract's files are torch.save's bytes, written with the GIL free
(``specshim.job.extract.torch_file``); whatever it cannot prove goes through
torch.save itself."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specshim.job.extract import torch_file


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """Each test starts with no layout checked and no fallback in force."""
    monkeypatch.setattr(torch_file, "_FALLBACK", [])
    monkeypatch.setattr(torch_file, "_CHECKED", set())
    monkeypatch.setattr(torch_file, "_LAYOUTS", {})


def _sample(tokens: int, hidden: int, layers: int, dtype: torch.dtype) -> dict:
    return {
        "input_ids": torch.arange(tokens),
        "hidden_states": [torch.randn(tokens, hidden).to(dtype) for _ in range(layers)],
        "loss_mask": torch.ones(tokens, dtype=torch.long),
    }


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    tokens=st.integers(0, 300),
    hidden=st.sampled_from([1, 8, 64, 200]),
    layers=st.integers(1, 5),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    name=st.from_regex(r"[a-z_0-9]{1,12}(\.[a-z0-9-]{1,9}){0,3}", fullmatch=True)
    | st.from_regex(r"\.[a-z_0-9]{1,12}(\.[a-z0-9-]{1,9}){1,3}", fullmatch=True),
)
def test_it_writes_torch_saves_bytes(
    tmp_path_factory, tokens, hidden, layers, dtype, name
):
    """Random samples under random names (the archive's folder inside the zip
    comes from the name, extract's own are ``.data_7.pt.RUN.partial``): every
    byte as torch.save writes it, and no fallback taken."""
    where = tmp_path_factory.mktemp("f")
    data = _sample(tokens, hidden, layers, dtype)
    torch.save(data, where / name)
    expected = (where / name).read_bytes()
    (where / name).unlink()
    torch_file.save(data, where / name)
    assert (where / name).read_bytes() == expected
    assert not torch_file._FALLBACK


def test_extracts_own_names_and_a_slab_view(tmp_path):
    """Rows handed over as views of one larger buffer (as a slab's are), under
    extract's temporary name: torch.save's bytes, and torch.load reads them."""
    slab = torch.randn(64, 32).to(torch.bfloat16)
    data = {
        "input_ids": torch.arange(10),
        "hidden_states": [slab[0:10], slab[10:20], slab[20:30]],
        "loss_mask": torch.ones(10, dtype=torch.long),
    }
    name = ".data_12.pt.0f3a9c.partial"
    (tmp_path / "ours").mkdir()
    (tmp_path / "torch").mkdir()
    torch_file.save(data, tmp_path / "ours" / name)
    torch.save(data, tmp_path / "torch" / name)
    ours = (tmp_path / "ours" / name).read_bytes()
    assert ours == (tmp_path / "torch" / name).read_bytes()
    loaded = torch.load(tmp_path / "ours" / name, weights_only=True)
    for got, sent in zip(loaded["hidden_states"], data["hidden_states"], strict=True):
        assert torch.equal(got, sent)
    assert not torch_file._FALLBACK


def test_bytes_that_differ_from_torch_save_are_never_written(
    tmp_path, monkeypatch, caplog
):
    """Where the first file of a shape does not match torch.save's bytes (here
    a CRC made wrong), torch.save writes it and every later file, and one
    warning says so."""
    real = torch_file.zlib.crc32
    first, second = _sample(5, 4, 2, torch.float32), _sample(6, 4, 3, torch.float32)
    (tmp_path / "ours").mkdir()
    (tmp_path / "torch").mkdir()
    with monkeypatch.context() as wrong, caplog.at_level(logging.WARNING):
        wrong.setattr(torch_file.zlib, "crc32", lambda data: real(data) ^ 1)
        torch_file.save(first, tmp_path / "ours" / "a.pt")
        torch_file.save(second, tmp_path / "ours" / "b.pt")
    torch.save(first, tmp_path / "torch" / "a.pt")
    torch.save(second, tmp_path / "torch" / "b.pt")
    assert torch_file._FALLBACK == [
        "_UnsupportedError: its bytes differ from torch.save's"
    ]
    warned = [r for r in caplog.records if "every file with torch.save" in r.message]
    assert len(warned) == 1
    for name in ("a.pt", "b.pt"):
        ours = (tmp_path / "ours" / name).read_bytes()
        assert ours == (tmp_path / "torch" / name).read_bytes()


def test_a_torch_whose_save_it_does_not_know_goes_through_torch_save(
    tmp_path, monkeypatch
):
    """torch's internal ``_save`` changed (here: a TypeError from it): the
    file is torch.save's own, nothing raises, and the reason is kept."""

    def changed(_obj):
        raise TypeError("_save() takes 6 positional arguments but 5 were given")

    monkeypatch.setattr(torch_file, "_records", changed)
    data = _sample(3, 4, 1, torch.float32)
    (tmp_path / "ours").mkdir()
    (tmp_path / "torch").mkdir()
    torch_file.save(data, tmp_path / "ours" / "a.pt")
    torch.save(data, tmp_path / "torch" / "a.pt")
    assert torch_file._FALLBACK == [
        "TypeError: _save() takes 6 positional arguments but 5 were given"
    ]
    ours = (tmp_path / "ours" / "a.pt").read_bytes()
    assert ours == (tmp_path / "torch" / "a.pt").read_bytes()


def test_a_full_disk_is_the_callers(tmp_path, monkeypatch):
    """An error writing the file is raised as torch.save's would be, not
    hidden behind a fallback."""

    def full(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch_file.os, "writev", full)
    with pytest.raises(OSError, match="No space left"):
        torch_file.save(_sample(3, 4, 1, torch.float32), tmp_path / "a.pt")
    assert not torch_file._FALLBACK


def test_a_file_past_zips_limit_alone_goes_through_torch_save(tmp_path, monkeypatch):
    """A sample past 4 GiB (here the limit made small) needs ZIP64 records:
    torch.save writes that file, and the next is written here again."""
    saved_by_torch = []
    real_save = torch.save

    def counting(obj, where, *args, **kwargs):
        if not isinstance(where, io.BytesIO):  # not the layout's check
            saved_by_torch.append(where)
        return real_save(obj, where, *args, **kwargs)

    monkeypatch.setattr(torch, "save", counting)
    big, small = _sample(64, 8, 2, torch.float32), _sample(2, 8, 2, torch.float32)
    monkeypatch.setattr(torch_file, "_LIMIT", 4096)  # 2,397 and 7,325 bytes
    torch_file.save(big, tmp_path / "big.pt")
    torch_file.save(small, tmp_path / "small.pt")
    assert saved_by_torch == [tmp_path / "big.pt"]
    assert not torch_file._FALLBACK
    for name, data in (("big.pt", big), ("small.pt", small)):
        loaded = torch.load(tmp_path / name, weights_only=True)
        assert torch.equal(loaded["hidden_states"][1], data["hidden_states"][1])
