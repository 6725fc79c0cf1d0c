"""ParityCodec: Reed-Solomon over K data cells and M parity cells of one size.

Built on pyeclib (BSD-2), whose wheel bundles liberasurecode and Intel ISA-L. pyeclib speaks
in fragments: ``encode`` of the K cells laid end to end returns K + M fragments whose
payloads are the K cells themselves and the M parity cells, each behind a header that holds
no checksum of the payload and depends only on (K, M, cell size, backend). So the parity
files hold bare parity bytes, and a rebuild gives every surviving cell the header of an
encode of zeros of the same shape (checked when the codec is built: the payloads must be
exactly the cells, or the codec refuses the cell size).
"""

from __future__ import annotations

import errno
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from shardio._check import require_int
from shardio.errors import IntegrityError, MissingExtraError, UsageError

__all__ = ["MAX_DATA", "MAX_PARITY", "ParityCodec", "parse_scheme"]

MAX_DATA = 64  # data shards per group
MAX_PARITY = 16  # parity shards per group
BACKEND = "isa_l_rs_vand"
_SCHEME = re.compile(r"([0-9]{1,3})\+([0-9]{1,3})")
_HEADER_GUESS = 80  # liberasurecode's header; measured, not assumed, in __init__


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
        MissingExtraError: pyeclib is not installed (``pip install 'shardio[parity]'``).
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
            zeros = self._driver.encode(bytes(self.k * self.cell_bytes))
        header = len(zeros[0]) - self.cell_bytes
        if header < 0 or any(len(f) != header + self.cell_bytes for f in zeros):
            raise UsageError(  # pragma: no cover - a pyeclib whose layout shardio does not know
                f"pyeclib's {BACKEND} does not lay {self.cell_bytes}-byte cells out whole"
            )
        self._header = header
        self._templates = [bytes(f[:header]) for f in zeros]

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
        return [bytes(f[self._header :]) for f in fragments[self.k :]]

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
        have = [self._templates[i] + bytes(c) for i, c in present[: self.k]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rebuilt = self._driver.reconstruct(have, targets)
        return {i: bytes(f[self._header :]) for i, f in zip(targets, rebuilt, strict=True)}

    def _check_row(self, cells: Sequence[Any], count: int, what: str) -> None:
        if len(cells) != count:
            raise UsageError(f"a row needs {count} {what} cells, got {len(cells)}")
        for cell in cells:
            if len(cell) != self.cell_bytes:
                raise UsageError(f"a cell is {self.cell_bytes} bytes, got one of {len(cell)}")
