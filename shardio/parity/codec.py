"""ParityCodec: Reed-Solomon over K data cells and M parity cells of one size.

Built on pyeclib (BSD-2), whose wheel bundles liberasurecode and Intel ISA-L. pyeclib speaks
in fragments: ``encode`` of the K cells laid end to end returns K + M fragments whose
payloads are the K cells themselves and the M parity cells, each behind a header that holds
no checksum of the payload and depends only on (K, M, cell size, backend). So the parity
files hold bare parity bytes, and a rebuild gives every surviving cell the header of an
encode of zeros of the same shape (checked when the codec is built: the payloads must be
exactly the cells, or the codec refuses the cell size).

Encoding (the hot path of ``pack --parity``) goes straight to the ISA-L library the wheel
bundles, through ctypes, with the calls liberasurecode's ``isa_l_rs_vand`` makes
(``gf_gen_rs_matrix``, ``ec_init_tables``, ``ec_encode_data``), into the caller's buffers:
pyeclib's own encode copies every data cell into a fragment first and runs about 40 times
slower here. The fast path is used only when it gives, for a random row, exactly the parity
pyeclib gives; else pyeclib's encode is used. Rebuilding always goes through pyeclib.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import logging
import mmap
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from shardio._check import require_int
from shardio.errors import IntegrityError, MissingExtraError, UsageError
from shardio.format.parity import MAX_PARITY_DATA, MAX_PARITY_PARITY, PARITY_BACKENDS

__all__ = ["MAX_DATA", "MAX_PARITY", "ParityCodec", "parse_scheme"]

MAX_DATA = MAX_PARITY_DATA  # data shards per group
MAX_PARITY = MAX_PARITY_PARITY  # parity shards per group
BACKEND = PARITY_BACKENDS[0]
_SCHEME = re.compile(r"([0-9]{1,3})\+([0-9]{1,3})")
_HEADER_GUESS = 80  # liberasurecode's header; measured, not assumed, in __init__
logger = logging.getLogger(__name__)
Buffer = bytearray | mmap.mmap  # a writable buffer
_ISAL: list[Any] = []  # the loaded library (or None when there is none), once per process


def _isal_library() -> Any:
    """ISA-L as the pyeclib wheel bundles it (``pyeclib.libs/libisal*.so*``), or None."""
    if _ISAL:
        return _ISAL[0]
    lib = None
    try:
        import pyeclib

        folder = os.path.join(os.path.dirname(os.path.dirname(pyeclib.__file__)), "pyeclib.libs")
        for path in sorted(glob.glob(os.path.join(folder, "libisal*.so*"))):
            lib = ctypes.CDLL(path)
            break
        if lib is not None:
            voidp, cint = ctypes.c_void_p, ctypes.c_int
            lib.gf_gen_rs_matrix.argtypes = [voidp, cint, cint]
            lib.ec_init_tables.argtypes = [cint, cint, voidp, voidp]
            lib.ec_encode_data.argtypes = [cint, cint, cint, voidp, voidp, voidp]
            for fn in (lib.gf_gen_rs_matrix, lib.ec_init_tables, lib.ec_encode_data):
                fn.restype = None
    except (ImportError, OSError, AttributeError) as exc:
        logger.debug("no ISA-L for the fast encode: %s", exc)
        lib = None
    _ISAL.append(lib)
    return lib


def _address(buf: bytearray | memoryview | mmap.mmap) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


class _FastEncode:
    """ISA-L's ``ec_encode_data`` for one (K, M): the tables liberasurecode builds."""

    def __init__(self, lib: Any, k: int, m: int) -> None:
        self.lib, self.k, self.m = lib, k, m
        matrix = (ctypes.c_ubyte * ((k + m) * k))()
        lib.gf_gen_rs_matrix(matrix, k + m, k)
        self.tables = (ctypes.c_ubyte * (32 * k * m))()
        lib.ec_init_tables(k, m, ctypes.byref(matrix, k * k), self.tables)

    def __call__(self, data: Sequence[Buffer], parity: Sequence[Buffer], length: int) -> None:
        pointers = ctypes.c_void_p * len(data)
        outs = ctypes.c_void_p * len(parity)
        self.lib.ec_encode_data(
            length, self.k, self.m, self.tables,
            pointers(*map(_address, data)), outs(*map(_address, parity)),
        )  # fmt: skip


def parse_scheme(text: object) -> tuple[int, int]:
    """``"10+2"`` as (10, 2): K data shards and M parity shards per group.

    Raises:
        UsageError: not ``K+M`` with 1 <= K <= 64, 1 <= M <= 16 and M <= K.
    """
    match = _SCHEME.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise UsageError(f"invalid parity scheme {text!r}: give K+M, for example 10+2")
    k, m = int(match.group(1)), int(match.group(2))
    if not 1 <= k <= MAX_DATA or not 1 <= m <= MAX_PARITY or m > k:
        raise UsageError(
            f"invalid parity scheme {text!r}: need 1 <= K <= {MAX_DATA}, 1 <= M <= "
            f"{MAX_PARITY} and M <= K"
        )
    return k, m


def _driver_class() -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pyeclib warns about backends shardio never uses
            from pyeclib.ec_iface import ECDriver
    except ImportError as exc:
        raise MissingExtraError("shardio parity needs pyeclib", "parity", str(exc)) from exc
    return ECDriver


class ParityCodec:
    """K data cells in, M parity cells out; any K of the K + M cells in, the others out.

    Args:
        k: data cells per row (data shards per group), 1 to 64.
        m: parity cells per row, 1 to 16, at most ``k``.
        cell_bytes: the size of every cell, a multiple of 4 KiB from 4 KiB to 64 MiB.

    Raises:
        UsageError: an argument out of range.
        MissingExtraError: pyeclib is not installed (``pip install pyeclib``).
    """

    def __init__(self, k: int, m: int, cell_bytes: int) -> None:
        self.k = require_int(k, "data shards per group (K)", minimum=1, maximum=MAX_DATA)
        self.m = require_int(m, "parity shards per group (M)", minimum=1, maximum=MAX_PARITY)
        if self.m > self.k:
            raise UsageError(f"parity shards per group ({m}) must be at most the data shards ({k})")
        self.cell_bytes = require_int(cell_bytes, "cell_bytes", minimum=4096, maximum=64 << 20)
        if self.cell_bytes % 4096:
            raise UsageError(f"cell_bytes must be a multiple of 4 KiB, got {cell_bytes}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._driver = _driver_class()(k=self.k, m=self.m, ec_type=BACKEND)
        self._layout: tuple[int, list[bytes]] | None = None  # pyeclib's, on first use
        self._fast = self._fast_encode()

    def _fragments(self) -> tuple[int, list[bytes]]:
        """pyeclib's fragment header size and each fragment's header for this shape, from an
        encode of zeros (checked: the payloads must be exactly the cells)."""
        if self._layout is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                zeros = self._driver.encode(bytes(self.k * self.cell_bytes))
            header = len(zeros[0]) - self.cell_bytes
            if header < 0 or any(len(f) != header + self.cell_bytes for f in zeros):
                raise UsageError(  # pragma: no cover - a pyeclib layout shardio does not know
                    f"pyeclib's {BACKEND} does not lay {self.cell_bytes}-byte cells out whole"
                )
            self._layout = (header, [bytes(f[:header]) for f in zeros])
        return self._layout

    def _fast_encode(self) -> _FastEncode | None:
        """ISA-L's encode, when it gives pyeclib's parity for a random row (else None)."""
        lib = _isal_library()
        if lib is None:
            return None
        try:
            fast = _FastEncode(lib, self.k, self.m)
            size = 4096
            row = [bytearray(os.urandom(size)) for _ in range(self.k)]
            out = [bytearray(size) for _ in range(self.m)]
            fast(row, out, size)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                driver = _driver_class()(k=self.k, m=self.m, ec_type=BACKEND)
                fragments = driver.encode(b"".join(row))
            head = len(fragments[0]) - size
            if [bytes(f[head:]) for f in fragments[self.k :]] != [bytes(p) for p in out]:
                logger.warning("ISA-L's encode differs from pyeclib's here: using pyeclib's")
                return None
        except (OSError, ValueError, TypeError) as exc:  # pragma: no cover - a foreign build
            logger.debug("ISA-L's encode unusable: %s", exc)
            return None
        return fast

    @property
    def fast(self) -> bool:
        """Whether :meth:`encode_into` runs ISA-L directly."""
        return self._fast is not None

    def __repr__(self) -> str:
        return f"ParityCodec({self.k}+{self.m}, cell {self.cell_bytes} bytes)"

    def __getstate__(self) -> dict[str, int]:
        return {"k": self.k, "m": self.m, "cell_bytes": self.cell_bytes}

    def __setstate__(self, state: Mapping[str, int]) -> None:
        self.__init__(state["k"], state["m"], state["cell_bytes"])  # type: ignore[misc]

    def encode(self, cells: Sequence[bytes | bytearray | memoryview]) -> list[bytes]:
        """The M parity cells of K data cells (each exactly ``cell_bytes``).

        Raises:
            UsageError: not K cells of ``cell_bytes`` each.
        """
        self._check_row(cells, self.k, "data")
        fragments = self._driver.encode(b"".join(cells))
        header = self._fragments()[0]
        return [bytes(f[header:]) for f in fragments[self.k :]]

    def encode_into(self, cells: Sequence[Buffer], parity: Sequence[Buffer]) -> None:
        """Write the M parity cells of K data cells (each exactly ``cell_bytes``, in
        writable buffers) into ``parity`` (M buffers of ``cell_bytes``): no copy of the data.

        Raises:
            UsageError: not K data cells and M parity buffers of ``cell_bytes`` each.
        """
        self._check_row(cells, self.k, "data")
        self._check_row(parity, self.m, "parity")
        if self._fast is not None:
            self._fast(cells, parity, self.cell_bytes)
            return
        for out, cell in zip(parity, self.encode([memoryview(c) for c in cells]), strict=True):
            out[:] = cell

    def rebuild(
        self,
        cells: Sequence[bytes | bytearray | memoryview | None],
        wanted: Sequence[int] | None = None,
    ) -> dict[int, bytes]:
        """Cells of one row rebuilt from the others: ``cells`` holds K + M entries (data,
        then parity), None where a cell is lost or was not read; returns {index: cell} for
        each index of ``wanted`` (default: every None). K present cells are enough.

        Raises:
            IntegrityError: fewer than K cells present (the row is beyond repair).
            UsageError: not K + M entries, a wanted index out of range or present, or a cell
                of another size.
        """
        total = self.k + self.m
        if len(cells) != total:
            raise UsageError(f"a row has {total} cells (K + M), got {len(cells)}")
        targets = [i for i, c in enumerate(cells) if c is None] if wanted is None else list(wanted)
        if not targets:
            return {}
        if any(not 0 <= i < total or cells[i] is not None for i in targets):
            raise UsageError(f"cells to rebuild must be missing indices below {total}: {targets}")
        present = [(i, c) for i, c in enumerate(cells) if c is not None]
        if len(present) < self.k:
            raise IntegrityError(
                errno.EIO,
                f"{total - len(present)} of {total} cells missing: more than the {self.m} "
                "parity can rebuild",
            )
        self._check_row([c for _, c in present], len(present), "surviving")
        header, templates = self._fragments()
        have = [templates[i] + bytes(c) for i, c in present[: self.k]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rebuilt = self._driver.reconstruct(have, targets)
        return {i: bytes(f[header:]) for i, f in zip(targets, rebuilt, strict=True)}

    def _check_row(self, cells: Sequence[Any], count: int, what: str) -> None:
        if len(cells) != count:
            raise UsageError(f"a row needs {count} {what} cells, got {len(cells)}")
        for cell in cells:
            if len(cell) != self.cell_bytes:
                raise UsageError(f"a cell is {self.cell_bytes} bytes, got one of {len(cell)}")
