"""Erasure-coded parity over groups of shards (``--parity K+M``), torch-free.

- ``codec``: :class:`ParityCodec`, Reed-Solomon over K data cells and M parity cells
  (pyeclib with its ISA-L backend, the ``parity`` extra; see benchmarks/RESULTS.md,
  "Erasure coding for --parity", for why);
- ``group``: :func:`encode_group` writes the M parity files of K data files, cell by cell
  in bounded memory, and :func:`rebuild_group` rebuilds any M lost files of a group.

The data files are never changed or padded: a file shorter than the group's longest reads as
zeros past its end. Parity files are as long as the group's longest data file (a column of
zeros has zero parity, so nothing past that is needed). Nothing is imported with the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardio._lazy import lazy_face

if TYPE_CHECKING:
    from shardio.parity.codec import ParityCodec, parse_scheme
    from shardio.parity.group import encode_group, rebuild_group

__all__ = ["ParityCodec", "encode_group", "parse_scheme", "rebuild_group"]

__getattr__, __dir__ = lazy_face(
    __name__,
    {
        "ParityCodec": "shardio.parity.codec",
        "parse_scheme": "shardio.parity.codec",
        "encode_group": "shardio.parity.group",
        "rebuild_group": "shardio.parity.group",
    },
)
