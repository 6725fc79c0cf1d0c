"""Count the metadata calls a pack makes on its source tree, where it makes them.

On a parallel filesystem every open and stat of a source file is a metadata server round
trip, so a pack reports what it asked of the source: how many directories it listed, how
many entries those held, how many stat calls it made (one per file it packs, none per
directory) and how many files it opened to pack them (one each; an ``fstat`` only for a
file streamed in chunks). The counts are plain integer additions beside the calls.

What is not counted: the C library's ``opendir`` makes one ``fstat`` on each directory it
opens (strace shows it; it is part of a directory listing here), the few calls that check
SRC itself before the scan, and, on a filesystem whose directory entries carry no file
type (``DT_UNKNOWN``; Lustre, ext4 and XFS with ``ftype=1`` carry it), the ``lstat``
Python's ``os.scandir`` then makes per entry to tell files from directories.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from shardio.errors import FormatError
from shardio.format.fields import get_field

__all__ = ["SourceCalls"]


@dataclass(slots=True, kw_only=True)
class SourceCalls:
    """A tally of the calls a pack made on its source tree (the scan and the shard writers
    add to it as they make them).

    Attributes:
        dirs_listed: directories read with ``os.scandir`` (each an open, the C library's
            ``fstat``, ``getdents`` calls and a close). Every part of a ``--part`` pack
            lists the whole tree, so that it computes the same global sample list.
        entries_seen: directory entries those listings returned (subdirectories included).
        stat_calls: ``stat``/``lstat`` calls on listed entries: one per file of the part
            (a symlink is stat'ed through, once), none per directory.
        opens: source files opened to be packed: one per file written into a shard.
        fstat_calls: ``fstat`` calls on opened source files: only files above the stream
            threshold, which are copied in chunks, are checked that way.
    """

    dirs_listed: int = 0
    entries_seen: int = 0
    stat_calls: int = 0
    opens: int = 0
    fstat_calls: int = 0

    def add(self, other: SourceCalls) -> None:
        """Add ``other``'s counts to this tally."""
        self.dirs_listed += other.dirs_listed
        self.entries_seen += other.entries_seen
        self.stat_calls += other.stat_calls
        self.opens += other.opens
        self.fstat_calls += other.fstat_calls

    def copy(self) -> SourceCalls:
        """An independent copy (a result keeps its own figures)."""
        return SourceCalls(**self.to_json())

    @classmethod
    def total(cls, tallies: list[SourceCalls]) -> SourceCalls:
        """The sum of several tallies."""
        out = cls()
        for t in tallies:
            out.add(t)
        return out

    def to_json(self) -> dict[str, int]:
        """The JSON form: one count per field."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> SourceCalls:
        """Validate a JSON object; a count it lacks (written by an older shardio) is 0.

        Raises:
            FormatError: ``doc`` is not an object or a count is mistyped or negative.
        """
        if not isinstance(doc, Mapping):
            raise FormatError(f"{where}: source_calls is not an object")
        counts: dict[str, int] = {}
        for f in fields(cls):
            if f.name in doc:
                value: int = get_field(doc, f.name, int, f"{where}: source_calls")
                if value < 0:
                    raise FormatError(f"{where}: source_calls field {f.name!r} is negative")
                counts[f.name] = value
        return cls(**counts)
