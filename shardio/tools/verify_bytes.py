"""Hash a shard's bytes and check each of its members against the index, through ``pread``.

Shards are read with ``pread`` into one reused buffer, never mapped: a file truncated while
it is read ends short instead of raising SIGBUS.
"""

from __future__ import annotations

from typing import Any

from shardio.format.checksum import hex64, new_file_hasher
from shardio.read.digest import member_digest_problem
from shardio.read.reader import ShardReader
from shardio.storage.files import refuse_irregular
from shardio.storage.opener import Opener, open_named, read_fully
from shardio.tools.verify_report import BadMember

__all__ = ["check_bytes", "file_digest"]

_CHUNK = 8 * 1024 * 1024


class _Reader:
    """Ranges of an open file read through the opener into one reused buffer.

    Not a mapping: a file truncated (or failing) while it is read gives a short read or an
    OSError here, where a mapping would kill the process with SIGBUS.
    """

    def __init__(self, opener: Opener, fd: int) -> None:
        self._opener = opener
        self._fd = fd
        self._buf = bytearray(_CHUNK)
        self._lo = self._hi = 0  # the range of the file that the buffer holds

    def view(self, lo: int, hi: int) -> memoryview:
        """Bytes [lo, hi) of the file, fewer when it ends first; valid until the next call."""
        if not (self._lo <= lo and hi <= self._hi):
            want = max(hi - lo, _CHUNK)
            if len(self._buf) < want:  # a member larger than the chunk
                self._buf = bytearray(want)
            got = read_fully(self._opener, self._fd, memoryview(self._buf)[:want], lo)
            self._lo, self._hi = lo, lo + got
        return memoryview(self._buf)[lo - self._lo : max(lo, min(hi, self._hi)) - self._lo]


def file_digest(ds: ShardReader, path: str, what: str) -> str:
    """xxh3-128 of the file at ``path``, read through the dataset's opener."""
    fd = open_named(ds.opener, path, what=what)
    try:
        refuse_irregular(fd, path, what=what, close=lambda _fd: None)
        hasher = new_file_hasher()
        _feed(hasher, _Reader(ds.opener, fd), 0, ds.opener.size(fd))
        return hasher.hexdigest()
    finally:
        ds.opener.close(fd)


def _feed(hasher: Any, reader: _Reader, lo: int, hi: int) -> None:
    """Hash bytes [lo, hi) of the file in chunks (what lies between members)."""
    while lo < hi:
        part = reader.view(lo, min(hi, lo + _CHUNK))
        if not part:
            return  # the file ended early: the whole-file checksum fails
        hasher.update(part)
        lo += len(part)


def _bad(ds: ShardReader, sample: int, mrec: Any, actual: str) -> BadMember:
    ext = ds.index.exts[int(mrec["ext_id"])]
    return BadMember(ds.key(sample), ext, hex64(int(mrec["xxh3_64"])), actual)


def _scan(ds: ShardReader, shard: int, fd: int, size: int) -> tuple[list[BadMember], str]:
    """Check every member of ``shard`` in the open file ``fd`` (``size`` bytes) and hash the
    whole file; return (the bad members, the file's xxh3-128)."""
    entry = ds.manifest.shards[shard]
    samples = ds.index.samples[entry.first_sample : entry.first_sample + entry.num_samples]
    reader = _Reader(ds.opener, fd)
    whole = new_file_hasher()
    bad: list[BadMember] = []
    pos = 0
    for i, rec in enumerate(samples):
        first = int(rec["first_member"])
        for m in range(first, first + int(rec["n_members"])):
            mrec = ds.index.members[m]
            off, msize = int(mrec["offset"]), int(mrec["size"])
            expected = int(mrec["xxh3_64"])
            if off + msize > size:
                bad.append(_bad(ds, entry.first_sample + i, mrec, "truncated"))
                continue
            in_order = off >= pos  # members in file order: hash the gap, then the member
            if in_order:
                _feed(whole, reader, pos, off)
            data = reader.view(off, off + msize)
            if len(data) < msize:  # the file shrank while it was read
                bad.append(_bad(ds, entry.first_sample + i, mrec, "truncated"))
                continue
            if in_order:
                whole.update(data)
                pos = off + msize
            actual = member_digest_problem(data, expected)
            if actual is not None:
                bad.append(_bad(ds, entry.first_sample + i, mrec, hex64(actual)))
    _feed(whole, reader, pos, size)
    return bad, whole.hexdigest()


def check_bytes(
    ds: ShardReader, shard: int, fd: int, reasons: list[str]
) -> tuple[list[BadMember], int]:
    """Scan an open shard file; add to ``reasons``; return (bad members, bytes checked)."""
    entry = ds.manifest.shards[shard]
    size = ds.opener.size(fd)
    if size == 0:
        return [], 0
    bad, digest = _scan(ds, shard, fd, size)
    if digest != entry.xxh3_128:
        if not bad:
            reasons.append("shard checksum mismatch outside sample data (tar headers or padding)")
        else:
            reasons.append(f"{len(bad)} damaged member(s)")
    return bad, size
