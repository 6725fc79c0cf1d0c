"""The manifest's ``parity`` section (format 3): the erasure code and its groups.

A dataset packed with ``--parity K+M`` cuts its shard list, in dataset order, into groups of
K consecutive shards (the last group may be shorter) and stores for each group M parity files
and one cell table (the xxh3-64 of every cell of every file of the group, so that a flipped
byte is a known loss at cell granularity). Parity files and cell tables are listed here with
their size and xxh3-128, like shards. The code itself (what the bytes mean) is described in
docs/format.md, "Parity"; this module only models and validates the section.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardio.errors import FormatError
from shardio.format.fields import MAX_INT, get_field

__all__ = [
    "PARITY_BACKENDS",
    "PARITY_DIR",
    "ParityFile",
    "ParityGroup",
    "ParitySection",
    "cells_path",
    "parity_path",
]

PARITY_DIR = "parity"
# The codes a reader knows: pyeclib's ISA-L Reed-Solomon (Vandermonde). A dataset whose
# parity was written with another is refused (its parity bytes mean something else).
PARITY_BACKENDS = ("isa_l_rs_vand",)
MAX_PARITY_DATA = 64
MAX_PARITY_PARITY = 16
MAX_ROW_BYTES = 256 << 20  # the buffers of one row (two per data file, one per parity file)
_HEX128 = re.compile(r"[0-9a-f]{32}")


def parity_path(group: int, j: int) -> str:
    """The relative path of parity file ``j`` of group ``group``."""
    return f"{PARITY_DIR}/group-{group:06d}.p{j}"


def cells_path(group: int) -> str:
    """The relative path of the cell table of group ``group``."""
    return f"{PARITY_DIR}/group-{group:06d}.cells"


@dataclass(frozen=True, kw_only=True, slots=True)
class ParityFile:
    """One file of the parity section: a parity file or a cell table."""

    path: str
    size_bytes: int
    xxh3_128: str

    def __post_init__(self) -> None:
        if not 0 <= self.size_bytes <= MAX_INT:
            raise FormatError(f"parity file {self.path!r}: size_bytes is out of range")
        if not _HEX128.fullmatch(self.xxh3_128):
            raise FormatError(
                f"parity file {self.path!r}: xxh3_128 must be 32 lower-case hex digits"
            )

    def to_json(self) -> dict[str, Any]:
        """The JSON object."""
        return {"path": self.path, "size_bytes": self.size_bytes, "xxh3_128": self.xxh3_128}

    @classmethod
    def from_json(cls, doc: object, where: str) -> ParityFile:
        """Validate a JSON object."""
        if not isinstance(doc, dict):
            raise FormatError(f"{where} must be an object")
        return cls(
            path=get_field(doc, "path", str, where),
            size_bytes=get_field(doc, "size_bytes", int, where),
            xxh3_128=get_field(doc, "xxh3_128", str, where),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ParityGroup:
    """One group: shards ``first_shard .. first_shard + num_shards - 1`` and their parity."""

    first_shard: int
    num_shards: int
    parity: tuple[ParityFile, ...]
    cells: ParityFile

    @property
    def shards(self) -> range:
        """The indices of the group's data shards."""
        return range(self.first_shard, self.first_shard + self.num_shards)

    def files(self) -> tuple[ParityFile, ...]:
        """Every file the group adds: its parity files, then its cell table."""
        return (*self.parity, self.cells)

    def to_json(self) -> dict[str, Any]:
        """The JSON object."""
        return {
            "first_shard": self.first_shard,
            "num_shards": self.num_shards,
            "parity": [p.to_json() for p in self.parity],
            "cells": self.cells.to_json(),
        }


@dataclass(frozen=True, kw_only=True)
class ParitySection:
    """The ``parity`` section of a format-3 manifest.

    Attributes:
        k: data shards per group.
        m: parity files per group (any ``m`` lost files of a group can be rebuilt).
        cell_bytes: the size of a cell: row ``r`` of a group is the bytes at
            ``r * cell_bytes`` of every file of the group.
        backend: the erasure code (one of :data:`PARITY_BACKENDS`).
        groups: the groups, in order; together they cover every shard once.
    """

    k: int
    m: int
    cell_bytes: int
    backend: str
    groups: tuple[ParityGroup, ...]

    def __post_init__(self) -> None:
        if not 1 <= self.k <= MAX_PARITY_DATA or not 1 <= self.m <= min(MAX_PARITY_PARITY, self.k):
            raise FormatError(f"parity scheme {self.k}+{self.m} is out of range")
        if not 4096 <= self.cell_bytes <= 64 << 20 or self.cell_bytes % 4096:
            raise FormatError(f"parity cell_bytes {self.cell_bytes} is out of range")
        if (2 * self.k + self.m) * self.cell_bytes > MAX_ROW_BYTES:  # what a row holds in memory
            raise FormatError(
                f"parity {self.k}+{self.m} with {self.cell_bytes}-byte cells needs more than "
                f"{MAX_ROW_BYTES >> 20} MiB per row: cells are too large for the scheme"
            )
        if self.backend not in PARITY_BACKENDS:
            raise FormatError(
                f"parity backend {self.backend!r} is unknown to this shardio (it knows "
                f"{', '.join(PARITY_BACKENDS)}); upgrade shardio"
            )
        for g, group in enumerate(self.groups):
            if len(group.parity) != self.m:
                raise FormatError(
                    f"parity group {g} has {len(group.parity)} parity files, not {self.m}"
                )
            # The names are fixed: a manifest cannot point a rebuild at any other file.
            names = [parity_path(g, j) for j in range(self.m)] + [cells_path(g)]
            for f, name in zip(group.files(), names, strict=True):
                if f.path != name:
                    raise FormatError(f"parity group {g}: file {f.path!r} should be {name!r}")

    @property
    def scheme(self) -> str:
        """``"K+M"``."""
        return f"{self.k}+{self.m}"

    def check_shards(self, sizes: Sequence[int]) -> None:
        """Check the groups against the shard list (``sizes``: each shard's size).

        Raises:
            FormatError: groups that do not cut the shard list into runs of K (the last one
                shorter), or a parity file whose size is not its group's longest shard's.
        """
        first = 0
        for g, group in enumerate(self.groups):
            last = g == len(self.groups) - 1
            if (
                group.first_shard != first
                or not 1 <= group.num_shards <= self.k
                or (group.num_shards != self.k and not last)
            ):
                raise FormatError(
                    f"parity group {g} (shards {group.first_shard}+{group.num_shards}) does "
                    f"not follow groups of {self.k} consecutive shards"
                )
            first += group.num_shards
            if first > len(sizes):
                raise FormatError(f"parity group {g} lists shards the manifest does not have")
            longest = max(sizes[i] for i in group.shards)
            for p in group.parity:
                if p.size_bytes != longest:
                    raise FormatError(
                        f"parity file {p.path!r} is {p.size_bytes} bytes: its group's longest "
                        f"shard is {longest}"
                    )
        if first != len(sizes):
            raise FormatError(
                f"the parity groups cover {first} shards, the manifest lists {len(sizes)}"
            )

    def group_of(self, shard: int) -> int:
        """The group that holds shard ``shard``."""
        return shard // self.k

    def files(self) -> list[ParityFile]:
        """Every file of the section, group by group."""
        return [f for group in self.groups for f in group.files()]

    @property
    def total_bytes(self) -> int:
        """Bytes of every parity file and cell table."""
        return sum(f.size_bytes for f in self.files())

    def to_json(self) -> dict[str, Any]:
        """The JSON object."""
        return {
            "scheme": self.scheme,
            "k": self.k,
            "m": self.m,
            "cell_bytes": self.cell_bytes,
            "backend": self.backend,
            "total_bytes": self.total_bytes,
            "groups": [g.to_json() for g in self.groups],
        }

    @classmethod
    def from_json(cls, doc: object, where: str) -> ParitySection:
        """Validate the JSON object (the shard list is checked by the manifest)."""
        if not isinstance(doc, Mapping):
            raise FormatError(f"{where}: parity must be an object or null")
        w = f"{where}: parity"
        k, m = get_field(doc, "k", int, w), get_field(doc, "m", int, w)
        scheme = get_field(doc, "scheme", str, w)
        if scheme != f"{k}+{m}":
            raise FormatError(f"{w}: scheme {scheme!r} does not match k={k}, m={m}")
        groups = []
        for g, item in enumerate(get_field(doc, "groups", list, w)):
            gw = f"{w}.groups[{g}]"
            if not isinstance(item, dict):
                raise FormatError(f"{gw} must be an object")
            files = get_field(item, "parity", list, gw)
            groups.append(
                ParityGroup(
                    first_shard=get_field(item, "first_shard", int, gw),
                    num_shards=get_field(item, "num_shards", int, gw),
                    parity=tuple(
                        ParityFile.from_json(f, f"{gw}.parity[{j}]") for j, f in enumerate(files)
                    ),
                    cells=ParityFile.from_json(get_field(item, "cells", dict, gw), f"{gw}.cells"),
                )
            )
        section = cls(
            k=k,
            m=m,
            cell_bytes=get_field(doc, "cell_bytes", int, w),
            backend=get_field(doc, "backend", str, w),
            groups=tuple(groups),
        )
        total = doc.get("total_bytes")
        if total is not None and total != section.total_bytes:
            raise FormatError(f"{w}: total_bytes does not match the parity file sizes")
        return section
