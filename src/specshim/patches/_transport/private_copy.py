"""Turning a shared mapping into this process's own memory where it stands:
the same addresses, the same bytes, now private and anonymous, so that a
forked child gets a copy-on-write copy of it as of any other memory, and the
file under it is no longer read. ``handed_states`` does it at a fork to the
slabs whose rows the caller still holds.

The bytes are copied into fresh anonymous memory, which ``mremap`` then moves
over the old range in one step: no thread ever sees the range unmapped or
half copied (a thread writing to it meanwhile would lose its write; specshim
writes to no rows it has handed out)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from typing import Any

_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2  # linux/mman.h
_MAP_FIXED = 0x10
_FAILED = ctypes.c_void_p(-1).value


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    size, address, number = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
    for name, returns, takes in (
        ("mmap", address, [address, size, number, number, number, ctypes.c_long]),
        ("mremap", address, [address, size, size, number, address]),
        ("munmap", number, [address, size]),
    ):
        function = getattr(libc, name)
        function.restype, function.argtypes = returns, takes
    return libc


def _failed(call: str) -> OSError:
    errno = ctypes.get_errno()
    return OSError(errno, f"{call}: {os.strerror(errno)}")


def make_private(mapping: mmap.mmap, fd: int | None = None) -> None:
    """Replace ``mapping``'s pages with a private anonymous copy of them, at
    the same address (Linux only; OSError where it cannot be done). ``fd``:
    the file under it, mapped back where ``mremap`` fails after unmapping the
    range (as it may for want of memory)."""
    if not sys.platform.startswith("linux"):
        raise OSError(f"moving a mapping is not supported on {sys.platform}")
    view = ctypes.c_char.from_buffer(mapping)  # writable: the mapping's start
    address = ctypes.addressof(view)
    del view
    size = len(mapping)
    length = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    libc = _libc()
    readable = mmap.PROT_READ | mmap.PROT_WRITE
    fresh = libc.mmap(
        None, length, readable, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
    )
    if fresh is None or fresh == _FAILED:
        raise _failed("mmap")
    ctypes.memmove(fresh, address, size)
    moved = libc.mremap(fresh, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, address)
    if moved == address:
        return
    error = _failed("mremap")
    libc.munmap(fresh, length)
    back = None
    if fd is not None:
        fixed = mmap.MAP_SHARED | _MAP_FIXED
        back = libc.mmap(address, length, readable, fixed, fd, 0)
    if back != address:  # the range may be unmapped: reading it would crash
        raise OSError(error.errno, f"{error.strerror}; the shared mapping is gone")
    raise error
