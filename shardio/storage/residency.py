"""Whether a range of an open file lies in the page cache: ``mmap`` + ``mincore``, no read.

A stream read-ahead that reads shards the page cache already holds reads every byte twice
(and once more per sibling worker) for nothing; ``RWF_NOWAIT`` would tell, but a FUSE
client refuses it. A shared read-only mapping of the range and ``mincore`` tell without
reading a byte and without a request to the filesystem's server (the mapping is made and
dropped in the kernel; no page is touched). Linux only; anywhere the calls are missing or
fail, the answer is "not resident" (the caller reads, as it did before).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys

__all__ = ["resident"]

_PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value
_LOW_BIT = bytes(b & 1 for b in range(256))


def _libc() -> ctypes.CDLL | None:
    """The C library's calls, through the process's own symbols (``dlopen(NULL)``: no search
    for the library, which ``ctypes.util.find_library`` does by running ``ldconfig``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_long,
        ]  # fmt: skip
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    except (OSError, AttributeError):
        return None
    return lib


_LIBC = _libc()


def resident(fd: int, offset: int, length: int) -> bool:
    """Whether every page of ``[offset, offset + length)`` of ``fd`` is in the page cache.

    ``offset`` is rounded down to a page. False where it cannot be told (not Linux, a file
    that cannot be mapped, a range past its end, a call that fails).
    """
    if _LIBC is None or length <= 0 or offset < 0:
        return False
    start = offset - offset % _PAGE
    span = offset + length - start
    with contextlib.suppress(OSError, ValueError, OverflowError, ctypes.ArgumentError):
        # Pages past the end of a file shorter than the range are never resident.
        addr = _LIBC.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        if addr is None or addr == _MAP_FAILED:
            return False
        try:
            vec = ctypes.create_string_buffer((span + _PAGE - 1) // _PAGE)
            if _LIBC.mincore(addr, span, vec) != 0:
                return False
            # Bit 0 of each byte: the page is resident (the other bits are reserved).
            return 0 not in vec.raw.translate(_LOW_BIT)
        finally:
            _LIBC.munmap(addr, span)
    return False
