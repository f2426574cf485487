"""``torch.save``'s files, byte for byte, written without the GIL.

``torch.save`` writes its zip archive through a C++ stream that holds the GIL
while it writes (on CPU, a thread that only counts ran at 0.65-0.75 of its
idle rate beside one thread saving 50 MB samples, at its full rate beside the
same saves in another process). ``extract``'s main thread schedules vLLM's
steps and takes their replies, and needs the GIL between steps: beside 8
writer threads moving 3 GB/s of states (a Kimi-width model on an H100),
``generate()`` took 11.0 s where it takes 8.8 s alone. ``save`` writes the
identical file with the GIL free for the bytes: the pickle and the records
come from torch's own ``_save``, the CRCs from ``zlib.crc32`` and the file
from ``os.writev``, both of which release it.

It takes the layout from torch, never assumes it: the first file of each
shape of archive (the number of storages, and whether any is written from
a ``Joined``'s pieces) is also made by ``torch.save`` in
memory and compared byte for byte. Any difference, a torch whose ``_save``
is not what this reads, or any other surprise while the archive is built
sends that and every later file through ``torch.save`` itself, with one
warning. A file past zip's 4 GiB (ZIP64 records) or with a storage not in
CPU memory goes through ``torch.save`` alone. Errors while writing the file
(a full disk) are the caller's, as ``torch.save``'s are.
tests/unit/test_torch_file.py holds it to ``torch.save``'s bytes for random
samples and names.

The format, as torch 2.x writes it: records in order, each a local header
(no sizes, data-descriptor flag), a ``FB`` extra field padded with ``Z`` so
the data starts on the storage alignment, the data, and a 16-byte data
descriptor; then the central directory, a ZIP64 end record and locator, and
the end record. After the records ``_save`` emits come the version record
and ``.data/serialization_id``: 20 digits of a hash of the record names (taken
from the reference file) and 20 of the records' CRCs combined in order.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import struct
import threading
import zlib
from pathlib import Path
from typing import Any

logger = logging.getLogger("specshim.job.extract.command")

_LIMIT = 0xFFFFFFFF  # past this, miniz writes ZIP64 fields: left to torch.save
_ID_RECORD = ".data/serialization_id"
_MASK = (1 << 64) - 1


class _UnsupportedError(Exception):
    """This object or file is left to ``torch.save``."""


class _ThisFileError(_UnsupportedError):
    """This file alone is left to ``torch.save`` (past 4 GiB, a storage not in
    CPU memory): the next is written here again."""


class _Records:
    """Stands in for torch's zip writer in ``_save``: keeps what it is given;
    a stand-in's storage (``_stand_ins``) as its rows' pieces."""

    def __init__(self, pieces: dict[int, list[Any]]) -> None:
        self.records: list[tuple[str, Any]] = []
        self.pieces = pieces
        self.pieced: set[int] = set()  # stand-ins written from their pieces

    def write_record(self, name: str, data: Any, size: int) -> None:
        if isinstance(data, str):
            data = data.encode()
        elif not isinstance(data, bytes):
            parts = self.pieces.get(data.data_ptr()) if size else None
            if parts is not None:
                self.pieced.add(data.data_ptr())
            data = _storage_bytes(data, size) if parts is None else _Pieces(parts)
            if _size(data) != size:
                raise _UnsupportedError(f"record {name} is not {size} bytes")
        self.records.append((name, data))

    def write_record_metadata(self, name: str, size: int) -> None:
        raise _UnsupportedError("skip_data is in force")


class _Pieces(list):  # type: ignore[type-arg]
    """One record's bytes as buffers, one after another."""


def _stand_ins(obj: Any, pieces: dict[int, list[Any]]) -> Any:
    """``obj`` with each ``Joined`` in it that is more than one tensor's own
    storage replaced by a tensor of its shape and dtype over storage nothing
    writes or reads (address space only), whose bytes are the ``Joined``'s
    pieces' (``pieces``, by that storage's address); one that is a single
    tensor's whole storage (or no rows) by that tensor, as
    ``joined_tensors`` gives ``torch.save``."""
    import torch

    from specshim._joined import replaced

    def stand_in(joined: Any) -> Any:
        if not joined.shape[0] or joined.lone() is not None:
            return joined.tensor()
        size = joined.numel() * joined.element_size()
        storage = torch.UntypedStorage(size, device="cpu")
        pieces[storage.data_ptr()] = [_tensor_bytes(part) for part in joined.parts]
        return torch.empty(0, dtype=joined.dtype).set_(storage, 0, joined.shape)

    return replaced(obj, stand_in)


def _tensor_bytes(tensor: Any) -> Any:
    """A packed CPU tensor's own bytes (not its storage's), as numpy."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise _ThisFileError(f"a piece on {tensor.device}, or not packed")
    width = tensor.element_size()
    start, size = tensor.storage_offset() * width, tensor.numel() * width
    return _bytes_of(tensor.untyped_storage(), start, size)


def _crc(data: Any) -> int:
    if isinstance(data, _Pieces):
        crc = 0
        for part in data:
            crc = zlib.crc32(part, crc)
        return crc
    return zlib.crc32(data)


def _size(data: Any) -> int:
    if isinstance(data, _Pieces):
        return sum(memoryview(part).nbytes for part in data)
    return memoryview(data).nbytes


def _storage_bytes(storage: Any, size: int) -> Any:
    if storage.device.type != "cpu" or storage.nbytes() != size:
        raise _ThisFileError(f"a storage on {storage.device}")
    return _bytes_of(storage, 0, size)


def _bytes_of(storage: Any, start: int, size: int) -> Any:
    """``size`` bytes of a CPU storage from byte ``start``, as numpy sharing
    the storage's memory (no copy)."""
    import torch

    flat = torch.empty(0, dtype=torch.uint8)
    flat.set_(storage, start, (size,))
    return flat.numpy()


def _combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64 bits."""
    return (seed ^ (value + 0x9E3779B9 + (seed << 6) + (seed >> 2))) & _MASK


def _archive_name(path: str) -> str:
    """The folder torch's writer names inside the archive: the file's name
    without its last suffix (``archive`` for a name that is not ASCII)."""
    try:
        path.encode("ascii")
    except UnicodeEncodeError:
        return "archive"
    name = path.rsplit("/", 1)[-1]
    stem = name.rsplit(".", 1)[0] if "." in name else name
    if not stem:
        raise _UnsupportedError(f"an archive name for {path!r}")
    return stem


class _Layout:
    """What the reference file of one shape of archive showed."""

    def __init__(self, alignment: int, ending: list[tuple[str, bytes]], names: str):
        self.alignment = alignment
        self.ending = ending  # records torch's writer adds at the end
        self.names_hash = names  # the serialization id's first 20 digits


_LAYOUTS: dict[int, _Layout] = {}
_CHECKED: set[tuple[int, bool]] = set()
_LOCK = threading.Lock()
_FALLBACK: list[str] = []  # why torch.save writes every file, once set


def _layout(storages: int) -> _Layout:
    """torch's own archive for ``storages`` tensors, read back."""
    import zipfile

    import torch

    found = _LAYOUTS.get(storages)
    if found is not None:
        return found
    buffer = io.BytesIO()
    torch.save([torch.zeros(1) for _ in range(storages)], buffer)
    archive = zipfile.ZipFile(buffer)
    infos = archive.infolist()
    names = [i.filename.split("/", 1)[1] for i in infos]
    if names[-1] != _ID_RECORD or f"data/{storages - 1}" not in names:
        raise _UnsupportedError("torch's archive is not laid out as expected")
    last = names.index(f"data/{storages - 1}")
    ending = [
        (name, archive.read(info))
        for name, info in zip(names[last + 1 : -1], infos[last + 1 : -1], strict=True)
    ]
    digits = archive.read(infos[-1]).decode()
    alignment = 64
    if ".storage_alignment" in names:
        alignment = int(archive.read(infos[names.index(".storage_alignment")]))
    found = _Layout(alignment, ending, digits[:20])
    _LAYOUTS[storages] = found
    return found


def _records(obj: Any) -> list[tuple[str, Any]]:
    import torch.serialization as serialization

    pieces: dict[int, list[Any]] = {}
    held = _stand_ins(obj, pieces)  # alive while _save reads it: unique addresses
    collected = _Records(pieces)
    serialization._save(held, collected, pickle, serialization.DEFAULT_PROTOCOL, False)
    if collected.pieced != pieces.keys():  # a stand-in's own bytes are no rows
        raise _UnsupportedError("a Joined was not written from its pieces")
    return collected.records


def _pad(cursor: int, name: bytes, alignment: int) -> bytes:
    start = cursor + 30 + len(name) + 4
    padding = -start % alignment
    return b"FB" + struct.pack("<H", padding) + b"Z" * padding


def _archive(obj: Any, path: str) -> tuple[list[Any], tuple[int, bool]]:
    """The file's bytes, as buffers in order (storages are views, not
    copies), and its shape: the number of storages, and whether any is
    written from pieces."""
    records = _records(obj)
    storages = sum(1 for name, _ in records if name.startswith("data/"))
    pieced = any(isinstance(data, _Pieces) for _, data in records)
    layout = _layout(storages)
    records += layout.ending
    crcs = [_crc(data) for _, data in records]  # outside the GIL
    combined = 0
    for (_, data), crc in zip(records, crcs, strict=True):
        if _size(data):  # torch's writer leaves empty records out
            combined = _combine(combined, crc)
    ident = (layout.names_hash + f"{combined:020d}").encode()
    records.append((_ID_RECORD, ident))
    crcs.append(zlib.crc32(ident))
    prefix = _archive_name(path) + "/"
    parts: list[Any] = []
    central: list[bytes] = []
    cursor = 0
    for (name, data), crc in zip(records, crcs, strict=True):
        full = (prefix + name).encode()
        size = _size(data)
        if size >= _LIMIT or cursor >= _LIMIT:
            raise _ThisFileError("an archive past 4 GiB")
        extra = _pad(cursor, full, layout.alignment)
        # miniz writes an empty record with no data descriptor (flags: UTF-8)
        flags = 0x808 if size else 0x800
        descriptor = struct.pack("<IIII", 0x08074B50, crc, size, size) if size else b""
        parts.append(_local_header(full, extra, flags) + full + extra)
        parts += data if isinstance(data, _Pieces) else [data]
        parts.append(descriptor)
        central.append(_central_header(full, crc, size, cursor, flags) + full)
        cursor += 30 + len(full) + len(extra) + size + len(descriptor)
    parts.append(_ending(b"".join(central), len(records), cursor))
    return parts, (storages, pieced)


def _local_header(name: bytes, extra: bytes, flags: int) -> bytes:
    # signature, version needed, flags (data descriptor, UTF-8), stored,
    # time, date, CRC and sizes (in the descriptor), name and extra lengths
    return struct.pack(
        "<IHHHHHIIIHH", 0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(extra)
    )


def _central_header(name: bytes, crc: int, size: int, offset: int, flags: int) -> bytes:
    return struct.pack(
        "<IHHHHHHIIIHHHHHII",
        0x02014B50,
        0,  # made by
        0,  # needed
        flags,
        0,  # stored
        0,  # time
        0,  # date
        crc,
        size,
        size,
        len(name),
        0,  # extra
        0,  # comment
        0,  # disk
        0,  # internal attributes
        0,  # external attributes
        offset,
    )


def _ending(directory: bytes, count: int, start: int) -> bytes:
    """The central directory, then the ZIP64 end record and locator (miniz
    writes them whatever the size), then the end record."""
    if start + len(directory) >= _LIMIT:
        raise _ThisFileError("an archive past 4 GiB")
    end64 = start + len(directory)
    return (
        directory
        + struct.pack(
            "<IQHHIIQQQQ",
            0x06064B50,
            44,
            0x031E,
            0x2D,
            0,
            0,
            count,
            count,
            len(directory),
            start,
        )
        + struct.pack("<IIQI", 0x07064B50, 0, end64, 1)
        + struct.pack(
            "<IHHHHIIH", 0x06054B50, 0, 0, count, count, len(directory), start, 0
        )
    )


def save(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)``, the same bytes (see the module docstring);
    a ``Joined`` in ``obj`` is written as the tensor it stands for, from its
    pieces."""
    import torch

    from specshim._joined import joined_tensors

    if not _FALLBACK:
        try:
            parts, shape = _archive(obj, os.fspath(path))
            if shape not in _CHECKED:
                _check(obj, shape)
        except _ThisFileError:
            pass
        except Exception as exc:  # noqa: BLE001 - anything unproven: torch.save
            _fall_back(f"{type(exc).__name__}: {exc}")
        else:
            _write(path, parts)
            return
    torch.save(joined_tensors(obj), path)


def _check(obj: Any, shape: tuple[int, bool]) -> None:
    """The first file of each shape: torch.save's bytes in memory (there the
    archive is named ``archive``), compared with ours for that name."""
    import torch

    from specshim._joined import joined_tensors

    with _LOCK:
        if shape in _CHECKED:
            return
        reference = io.BytesIO()
        torch.save(joined_tensors(obj), reference)
        parts, _ = _archive(obj, "archive.pt")
        ours = b"".join(memoryview(p).cast("B").tobytes() for p in parts)
        if ours != reference.getvalue():
            raise _UnsupportedError("its bytes differ from torch.save's")
        _CHECKED.add(shape)


def _fall_back(reason: str) -> None:
    with _LOCK:
        if not _FALLBACK:
            _FALLBACK.append(reason)
            logger.warning(
                "specshim: extract writes every file with torch.save from here "
                "on, which holds the GIL while it writes (%s)",
                reason,
            )


def _write(path: Path, parts: list[Any]) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        while views:
            done = os.writev(fd, views[:1024])
            while views and done >= views[0].nbytes:
                done -= views[0].nbytes
                views.pop(0)
            if done:
                views[0] = views[0][done:]
    finally:
        os.close(fd)
