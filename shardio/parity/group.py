"""One parity group on disk: write its M parity files and cell table, rebuild lost files.

A group is up to K data files (a short last group has fewer; the rest count as empty files)
and M parity files. Row ``r`` of the group is the cells at offset ``r * cell_bytes`` of every
file, a file shorter than that reading as zeros there. Both functions stream row by row, so
memory is ``(K + M) * cell_bytes`` whatever the shard sizes. Every byte is read through the
opener. Every file written goes to a temp name first and is published only once complete (a
rebuilt file only once its xxh3-128 matches the manifest's).

With the group's cell table (:mod:`shardio.parity.cells`), a rebuild checks every cell it
reads: a damaged cell of a survivor is a known loss for its row (another survivor is read in
its place), never fed to the decoder, and a group whose damage is spread over more than M
files is still rebuilt as long as no row has more than M bad cells.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import xxhash

from shardio.errors import IntegrityError, UsageError
from shardio.parity.cells import CellTable, cell_digest
from shardio.parity.codec import ParityCodec
from shardio.storage.atomic import create_temp, publish, storage_error, temp_path_for
from shardio.storage.files import refuse_irregular
from shardio.storage.opener import Opener, PosixOpener, open_named, read_fully

__all__ = ["EncodedGroup", "GroupFiles", "encode_group", "rebuild_group"]


@dataclass(frozen=True)
class GroupFiles:
    """The files of one group, as the manifest lists them.

    Attributes:
        data: the data files, in order (1 to K).
        sizes: their sizes.
        digests: their xxh3-128.
        parity: the M parity files.
        cells: the cell table.
    """

    data: Sequence[str]
    sizes: Sequence[int]
    digests: Sequence[str]
    parity: Sequence[str]
    cells: str

    @property
    def length(self) -> int:
        """The size of each parity file: the longest data file's."""
        return max(self.sizes)

    def path(self, k: int, index: int) -> str:
        """File ``index`` of the group (data ``0..K-1``, parity ``K..K+M-1``)."""
        return self.data[index] if index < k else self.parity[index - k]

    def size(self, k: int, index: int) -> int:
        """The size of file ``index``."""
        return self.sizes[index] if index < k else self.length

    def check(self, codec: ParityCodec) -> None:
        """Refuse a group the codec cannot hold."""
        if not 1 <= len(self.data) <= codec.k:
            raise UsageError(f"a group holds 1 to {codec.k} data files, got {len(self.data)}")
        if len(self.sizes) != len(self.data) or any(s < 0 for s in self.sizes):
            raise UsageError("give one size (>= 0) per data file")
        if len(self.digests) != len(self.data):
            raise UsageError("give one xxh3-128 per data file")
        if len(self.parity) != codec.m:
            raise UsageError(f"a group has {codec.m} parity files, got {len(self.parity)}")


@dataclass(frozen=True)
class EncodedGroup:
    """What :func:`encode_group` wrote: (size, xxh3-128) of each parity file, of the table."""

    parity: tuple[tuple[int, str], ...]
    cells: tuple[int, str]


class _Reader:
    """Cells of one file of the group, zeros past ``size``; hashes what it reads in order.

    ``path`` None: a data file a short group lacks (all zeros). A file of another size than
    expected is read as it is when ``strict_size`` is off (its cells past the damage fail the
    cell table), refused otherwise.
    """

    def __init__(
        self, opener: Opener, path: str | None, size: int, what: str, *, strict_size: bool = True
    ) -> None:
        self.opener, self.path, self.size, self.fd = opener, path, size, -1
        self.actual = size
        self.hasher = xxhash.xxh3_128()
        if path is None:
            return
        self.fd = open_named(opener, path, what=what)
        refuse_irregular(self.fd, path, what=what, close=opener.close)
        self.actual = opener.size(self.fd)
        if self.actual != size and strict_size:
            self.close()
            raise IntegrityError(
                errno.EIO, f"{what} {path} is {self.actual:,} bytes, expected {size:,}"
            )

    def cell(self, offset: int, cell_bytes: int) -> bytes:
        buf = bytearray(cell_bytes)
        self.cell_into(buf, offset)
        return bytes(buf)

    def cell_into(self, buf: bytearray, offset: int) -> None:
        """Fill ``buf`` with the cell at ``offset`` (zeros past the file's end)."""
        cell_bytes = len(buf)
        view = memoryview(buf)
        want = max(0, min(cell_bytes, self.size - offset, self.actual - offset))
        if want and self.fd >= 0:
            got = read_fully(self.opener, self.fd, view[:want], offset)
            if got != want:
                raise IntegrityError(
                    errno.EIO,
                    f"{self.path} ended at {offset + got:,} bytes, expected {self.size:,}",
                )
        if want < cell_bytes:
            view[want:] = bytes(cell_bytes - want)
        self.hasher.update(view[: max(0, min(cell_bytes, self.size - offset))])

    def close(self) -> None:
        if self.fd >= 0:
            self.opener.close(self.fd)
            self.fd = -1


_ALIGN = 4096
_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned_buffer(size: int) -> mmap.mmap:
    """A zeroed, page-aligned writable buffer (what an ``O_DIRECT`` write needs)."""
    return mmap.mmap(-1, size)


class _Writer:
    """A file written to its temp name, hashed as written, published by :meth:`publish`.

    With ``direct``, whole aligned cells from aligned buffers are written with ``O_DIRECT``
    where the filesystem takes it: parity is written once and rarely read, so it goes to disk
    without filling the page cache (here that also writes it several times faster). Anything
    else (a partial last cell, a filesystem that refuses ``O_DIRECT``) is written buffered.
    """

    def __init__(self, final: str, *, direct: bool = False) -> None:
        self.final, self.tmp = final, temp_path_for(final)
        self.fd = create_temp(self.tmp)
        self.hasher = xxhash.xxh3_128()
        self.size = 0
        self.direct = False
        if direct and _DIRECT:
            with contextlib.suppress(OSError):
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | _DIRECT)
                self.direct = True

    def _buffered(self) -> None:
        if self.direct:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~_DIRECT)
            self.direct = False

    def write(self, data: bytes | memoryview | mmap.mmap) -> None:
        view = memoryview(data)
        self.hasher.update(view)
        self.size += len(view)
        if self.direct and len(view) % _ALIGN:
            self._buffered()  # the last, partial cell
        while view:
            try:
                view = view[os.write(self.fd, view) :]
            except OSError as exc:
                if not (self.direct and exc.errno == errno.EINVAL):
                    raise storage_error(exc, self.final, "writing") from exc
                self._buffered()  # the filesystem took the flag but not the write

    def publish(self, durable: bool) -> None:
        fd, self.fd = self.fd, -1
        os.close(fd)
        try:
            publish(self.tmp, self.final, durable=durable)  # a full disk may show at its fsync
        except OSError as exc:
            raise storage_error(exc, self.final, "writing") from exc

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)


def encode_group(
    files: GroupFiles,
    codec: ParityCodec,
    *,
    opener: Opener | None = None,
    durable: bool = True,
) -> EncodedGroup:
    """Write the M parity files and the cell table of a group of data files.

    Every data file is hashed as it is read and must match its xxh3-128 (parity of damaged
    bytes would rebuild the damage); nothing is published otherwise.

    Raises:
        IntegrityError: a data file is not the size or the bytes recorded.
        StorageError: a data file cannot be read, or a parity file cannot be written.
    """
    files.check(codec)
    reader = opener if opener is not None else PosixOpener()
    k, cell, length = codec.k, codec.cell_bytes, files.length
    readers: list[_Reader] = []
    writers: list[_Writer] = []
    rows: list[list[int]] = []
    try:
        readers = [
            _Reader(reader, p, s, "data shard")
            for p, s in zip(files.data, files.sizes, strict=True)
        ]
        writers = [_Writer(p, direct=True) for p in files.parity]
        # Two buffers per data column, reused row after row (no copy of the data on the way):
        # a helper thread reads (and hashes) row n + 1 while this one encodes and writes row
        # n; both run mostly without the GIL. (A third stage for the writes measured slower.)
        spare = [[bytearray(cell) for _ in readers] for _ in range(2)]
        zeros = [bytearray(cell) for _ in range(k - len(files.data))]  # a short group's
        parity = [aligned_buffer(cell) for _ in files.parity]

        def read_row(offset: int, cells: list[bytearray]) -> list[int]:
            for r, buf in zip(readers, cells, strict=True):
                r.cell_into(buf, offset)
            return [cell_digest(c) for c in cells]

        offsets = list(range(0, length, cell))
        with concurrent.futures.ThreadPoolExecutor(1) as ahead:
            reading = ahead.submit(read_row, 0, spare[0]) if offsets else None
            for n, offset in enumerate(offsets):
                assert reading is not None
                digests, cells = reading.result(), spare[n % 2]
                reading = None
                if n + 1 < len(offsets):
                    reading = ahead.submit(read_row, offsets[n + 1], spare[(n + 1) % 2])
                codec.encode_into(cells + zeros, parity)
                rows.append(digests + [cell_digest(memoryview(p)) for p in parity])
                keep = min(cell, length - offset)
                for writer, parity_cell in zip(writers, parity, strict=True):
                    writer.write(memoryview(parity_cell)[:keep])
        for r, expected in zip(readers, files.digests, strict=True):
            if r.hasher.hexdigest() != expected:
                raise IntegrityError(
                    errno.EIO,
                    f"data shard {r.path} does not match its manifest checksum: parity is "
                    "only computed over verified shards (repair it first)",
                )
        table = CellTable.build(k, codec.m, cell, rows, len(files.data)).dumps()
        writers.append(_Writer(files.cells))
        writers[-1].write(table)
        for writer in writers:
            writer.publish(durable)
        parity_out = tuple((w.size, w.hasher.hexdigest()) for w in writers[:-1])
        return EncodedGroup(parity_out, (writers[-1].size, writers[-1].hasher.hexdigest()))
    except BaseException:
        for writer in writers:
            writer.discard()
        raise
    finally:
        for r in readers:
            r.close()


def rebuild_group(
    files: GroupFiles,
    codec: ParityCodec,
    lost: Mapping[int, str],
    *,
    table: CellTable | None,
    opener: Opener | None = None,
    durable: bool = True,
    out: Mapping[int, str] | None = None,
) -> dict[int, str]:
    """Rebuild the files ``lost`` names (index -> the xxh3-128 it must have) and publish each
    only when its digest matches.

    Indices ``0 .. len(data) - 1`` are the data files, ``K .. K + M - 1`` the parity files.
    A file not in ``lost`` is never written. Each row reads K good cells of the other files
    (free zeros for the files a short group lacks first, then data, then parity); with the
    cell table, a survivor's bad cell is passed over for another, and when too few survivors
    are good the lost files' own cells that still match the table are used. Without a table
    (it is lost too) the survivors' whole-file digests are what vouch for them: a damaged
    survivor makes the rebuilt file fail its digest, and nothing is published.

    Args:
        out: where to write each rebuilt file instead of over its own path (a staging area).

    Returns:
        {index: the path written}.

    Raises:
        IntegrityError: a row with fewer than K good cells (beyond repair), or a rebuilt
            file whose digest differs; nothing of the group is published then.
        UsageError: an index that is no file of the group.
    """
    files.check(codec)
    k, m, cell = codec.k, codec.m, codec.cell_bytes
    real = list(range(len(files.data))) + list(range(k, k + m))
    bad = sorted(set(lost) - set(real))
    if bad:
        raise UsageError(f"indices {bad} are no file of this group (data 0-{len(files.data) - 1}, "
                         f"parity {k}-{k + m - 1})")  # fmt: skip
    if not lost:
        return {}
    if table is None and len(lost) > m:
        raise IntegrityError(errno.EIO, _beyond(files, k, m, sorted(lost)))
    reader = opener if opener is not None else PosixOpener()
    survivors = list(range(len(files.data), k)) + [i for i in real if i not in lost]
    # The lost files' own cells are read only when the survivors fall short, and only
    # where the cell table can vouch for them.
    order = survivors + (sorted(lost) if table is not None else [])
    readers: dict[int, _Reader | None] = {}  # None: the file cannot be read (missing, failing)
    failures: dict[int, str] = {}
    targets = {i: (out or {}).get(i, files.path(k, i)) for i in lost}
    writers: dict[int, _Writer] = {}

    def open_reader(i: int) -> _Reader | None:
        if i not in readers:
            try:
                if i >= len(files.data) and i < k:
                    readers[i] = _Reader(reader, None, 0, "")
                else:
                    what = "data shard" if i < k else "parity shard"
                    readers[i] = _Reader(
                        reader, files.path(k, i), files.size(k, i), what, strict_size=table is None
                    )
            except OSError as exc:
                readers[i], failures[i] = None, str(exc)
        return readers[i]

    try:
        writers = {i: _Writer(targets[i]) for i in sorted(lost)}
        for row, offset in enumerate(range(0, files.length, cell)):
            good: dict[int, bytes] = {}
            for i in order:
                if len(good) == k:
                    break
                r = open_reader(i)
                if r is None:
                    continue
                try:
                    got = r.cell(offset, cell)
                except OSError as exc:  # a read that fails now fails the rest of the file
                    r.close()
                    readers[i], failures[i] = None, str(exc)
                    continue
                if table is None or table.matches(row, i, got):
                    good[i] = got
            if len(good) < k and len(lost) > m and all(readers.get(i) is None for i in lost):
                raise IntegrityError(errno.EIO, _beyond(files, k, m, sorted(lost)))
            if len(good) < k:
                raise IntegrityError(
                    errno.EIO,
                    f"{_beyond(files, k, m, sorted(lost))}: row {row} (bytes {offset:,}+) has "
                    f"only {len(good)} good cells of the {k} needed"
                    + (f" ({'; '.join(failures.values())})" if failures else ""),
                )
            missing = [i for i in sorted(lost) if i not in good]
            present: list[bytes | None] = [good.get(i) for i in range(k + m)]
            rebuilt = codec.rebuild(_first_k(present, k), wanted=missing) if missing else {}
            for i in sorted(lost):
                data = good[i] if i in good else rebuilt[i]
                if table is not None and i not in good and not table.matches(row, i, data):
                    raise IntegrityError(
                        errno.EIO, f"rebuilt row {row} of {files.path(k, i)} fails its cell table"
                    )
                keep = max(0, min(cell, files.size(k, i) - offset))
                if keep:
                    writers[i].write(memoryview(data)[:keep])
        for i, writer in writers.items():
            digest = writer.hasher.hexdigest()
            if writer.size != files.size(k, i) or digest != lost[i]:
                raise IntegrityError(
                    errno.EIO,
                    f"rebuilt {files.path(k, i)} does not match its manifest checksum (expected "
                    f"{lost[i]}, got {digest}): another file of its group is damaged too",
                )
        for writer in writers.values():
            writer.publish(durable)
        return {i: w.final for i, w in writers.items()}
    except BaseException:
        for writer in writers.values():
            writer.discard()
        raise
    finally:
        for r in readers.values():
            if r is not None:
                r.close()


def _first_k(cells: list[bytes | None], k: int) -> list[bytes | None]:
    """The row with only its first K present cells (what the decoder is given)."""
    kept, out = 0, list[bytes | None]()
    for c in cells:
        if c is not None and kept < k:
            out.append(c)
            kept += 1
        else:
            out.append(None)
    return out


def _beyond(files: GroupFiles, k: int, m: int, lost: Sequence[int]) -> str:
    names = ", ".join(os.path.basename(files.path(k, i)) for i in lost)
    return (
        f"{len(lost)} files of one group lost ({names}): beyond what its {m} parity files can "
        "rebuild"
    )
