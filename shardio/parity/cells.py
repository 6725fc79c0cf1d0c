"""The cell table of a parity group: the xxh3-64 of every cell of every file of the group.

An erasure code repairs only what it is told is lost. The table turns any flipped byte into a
known loss of one cell (as MinIO's bitrot hashes do), so a rebuild never feeds a damaged cell
to the decoder and can repair a group whose damage is spread over more than M files as long
as no row has more than M bad cells.

Layout (little-endian): a 32-byte header (magic ``SHDCELLS``, table version, K, M, the
group's data files, cell size, rows), then ``rows`` rows of ``data files + M`` xxh3-64 values:
the data files in order, then the parity files. A cell is hashed as the decoder sees it:
``cell_bytes`` long, zeros past the file's end.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from shardio.errors import FormatError

__all__ = ["CellTable", "cell_digest"]

MAGIC = b"SHDCELLS"
TABLE_VERSION = 1
_HEAD = struct.Struct("<8sHHHHIQ4x")


def cell_digest(cell: bytes | bytearray | memoryview) -> int:
    """The xxh3-64 of one cell."""
    return xxhash.xxh3_64_intdigest(cell)


@dataclass(frozen=True)
class CellTable:
    """The cell digests of one group: ``digests[row, column]`` (columns: data, then parity)."""

    k: int
    m: int
    num_data: int
    cell_bytes: int
    digests: np.ndarray  # (rows, num_data + m) uint64

    @property
    def rows(self) -> int:
        """Rows of the group (the longest data file, in cells, rounded up)."""
        return int(self.digests.shape[0])

    def column(self, index: int) -> int | None:
        """The column of file ``index`` of the group (data ``0..K-1``, parity ``K..K+M-1``);
        None for a data file the (short) group lacks."""
        if index < self.num_data:
            return index
        if index < self.k:
            return None
        return self.num_data + index - self.k

    def matches(self, row: int, index: int, cell: bytes | bytearray | memoryview) -> bool:
        """Whether ``cell`` is the cell the table holds for file ``index`` in ``row``."""
        column = self.column(index)
        if column is None:
            return not any(cell)
        return int(self.digests[row, column]) == cell_digest(cell)

    def dumps(self) -> bytes:
        """The table's bytes."""
        head = _HEAD.pack(
            MAGIC, TABLE_VERSION, self.k, self.m, self.num_data, self.cell_bytes, self.rows
        )
        return head + np.ascontiguousarray(self.digests, dtype="<u8").tobytes()

    @classmethod
    def build(
        cls, k: int, m: int, cell_bytes: int, rows: Sequence[Sequence[int]], num_data: int
    ) -> CellTable:
        """A table from its rows of digests."""
        digests = np.array(rows, dtype=np.uint64).reshape(len(rows), num_data + m)
        return cls(k, m, num_data, cell_bytes, digests)

    @classmethod
    def loads(
        cls, data: bytes, *, k: int, m: int, num_data: int, cell_bytes: int, rows: int, where: str
    ) -> CellTable:
        """Parse a table and check it describes the group the manifest says.

        Raises:
            FormatError: not a cell table, or one of another shape (naming ``where``).
        """
        if len(data) < _HEAD.size:
            raise FormatError(f"{where}: not a shardio cell table (too short)")
        magic, version, tk, tm, tdata, tcell, trows = _HEAD.unpack_from(data)
        if magic != MAGIC or version != TABLE_VERSION:
            raise FormatError(f"{where}: not a shardio cell table (version {version})")
        if (tk, tm, tdata, tcell, trows) != (k, m, num_data, cell_bytes, rows):
            raise FormatError(
                f"{where}: cell table of {tk}+{tm}, {tdata} data files, {tcell}-byte cells, "
                f"{trows} rows; the manifest's group is {k}+{m}, {num_data}, {cell_bytes}, {rows}"
            )
        body = data[_HEAD.size :]
        if len(body) != rows * (num_data + m) * 8:
            raise FormatError(f"{where}: cell table is {len(data)} bytes, not what its header says")
        digests = np.frombuffer(body, dtype="<u8").reshape(rows, num_data + m)
        return cls(k, m, num_data, cell_bytes, digests)

    @staticmethod
    def size_of(rows: int, num_data: int, m: int) -> int:
        """Bytes of a table of that shape."""
        return _HEAD.size + rows * (num_data + m) * 8
