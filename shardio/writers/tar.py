"""Tar shards in the WebDataset layout, with DALI's ``.idx`` index beside each."""

from __future__ import annotations

import contextlib
import os
import tarfile
from collections.abc import Sequence

from shardio.format.checksum import new_file_hasher
from shardio.format.spec import TAR_BLOCK
from shardio.storage.atomic import create_temp, publish, storage_error, temp_path_for

__all__ = ["TarShardWriter", "dali_index_text", "ustar_header"]

_ZEROS = bytes(TAR_BLOCK * 2)
# Small flushes: the bytes just read and hashed are still in the CPU cache when the kernel
# copies them into the page cache (8 MiB batches measured 2x slower in kernel time).
_FLUSH_BYTES = 256 * 1024
_MAX_IOV = 512
_MAX_USTAR_SIZE = 8**11 - 1


def _template() -> bytes:
    header = bytearray(TAR_BLOCK)
    header[100:108] = b"0000644\0"
    header[108:116] = b"0000000\0"
    header[116:124] = b"0000000\0"
    header[124:136] = b"00000000000\0"
    header[136:148] = b"00000000000\0"
    header[148:156] = b"        "
    header[156] = 0x30  # '0': regular file
    header[257:265] = b"ustar\x0000"
    header[329:337] = b"0000000\0"
    header[337:345] = b"0000000\0"
    return bytes(header)


_TEMPLATE = _template()
_TEMPLATE_SUM = sum(_TEMPLATE)
_TEMPLATE_SIZE_SUM = sum(_TEMPLATE[124:136])


def ustar_header(name: bytes, size: int) -> bytes:
    """Return the header block(s) of a regular-file member.

    Plain POSIX ustar (mode 0644, uid/gid 0, mtime 0, so output is reproducible); names over
    the ustar limits or sizes of 8 GiB and more get a pax extended header, as GNU tar writes.
    """
    prefix, base = b"", name
    if len(name) > 100:
        cut = name.rfind(b"/", 0, 156)
        if cut > 0 and len(name) - cut - 1 <= 100:
            prefix, base = name[:cut], name[cut + 1 :]
        else:
            base = b""
    if not base or size > _MAX_USTAR_SIZE:
        info = tarfile.TarInfo(name.decode("ascii"))
        info.size, info.mtime, info.mode = size, 0, 0o644
        info.uname = info.gname = ""
        return info.tobuf(tarfile.PAX_FORMAT, "ascii", "strict")
    header = bytearray(_TEMPLATE)
    header[0 : len(base)] = base
    size_field = b"%011o\0" % size
    header[124:136] = size_field
    header[345 : 345 + len(prefix)] = prefix
    # The checksum is the byte sum with the checksum field as spaces: template sum plus
    # what the name, size and prefix fields add over the template's zeros.
    total = _TEMPLATE_SUM + sum(base) + sum(prefix) + sum(size_field) - _TEMPLATE_SIZE_SUM
    header[148:156] = b"%06o\0 " % total
    return bytes(header)


class TarShardWriter:
    """Writes a WebDataset tar shard: members ``<key>.<ext>``, 512-byte ustar headers.

    Args:
        path: the final path of the shard.
        durable: fsync before publishing (off only for throwaway output).
    """

    suffix = ".tar"

    def __init__(self, path: str, *, durable: bool = True) -> None:
        self.path = path
        self._tmp = temp_path_for(path)
        self._durable = durable
        self._hasher = new_file_hasher()
        self._pos = 0
        self._pending: list[bytes | memoryview] = []
        self._pending_bytes = 0
        self.samples: list[tuple[str, list[tuple[str, int, int]]]] = []
        try:
            self._fd = create_temp(self._tmp)
        except OSError as exc:
            raise storage_error(exc, path, "creating") from exc

    def _queue(self, piece: bytes | memoryview) -> None:
        self._hasher.update(piece)
        self._pending.append(piece)
        self._pending_bytes += len(piece)
        self._pos += len(piece)
        if self._pending_bytes >= _FLUSH_BYTES or len(self._pending) >= _MAX_IOV:
            self._flush()

    def _flush(self) -> None:
        pieces = self._pending
        first = 0
        try:
            while first < len(pieces):
                written = os.writev(self._fd, pieces[first:])
                # Skip the pieces fully written; keep the tail of a partly written one.
                while first < len(pieces) and written >= len(pieces[first]):
                    written -= len(pieces[first])
                    first += 1
                if written:
                    pieces[first] = memoryview(pieces[first])[written:]
        except OSError as exc:
            raise storage_error(exc, self.path, "writing") from exc
        self._pending = []
        self._pending_bytes = 0

    def add_sample(
        self, key: str, label: int, members: Sequence[tuple[str, bytes, int]]
    ) -> list[tuple[int, int]]:
        """Append one sample's members ``(ext, data, xxh3_64)``; return ``(offset, size)``.

        The label travels as the sample's ``cls`` member, so ``label`` is not used here.
        """
        del label
        placed = []
        record = []
        for ext, data, _digest in members:
            name = f"{key}.{ext}"
            self._queue(ustar_header(name.encode("ascii"), len(data)))
            offset = self._pos
            self._queue(data)
            pad = -len(data) % TAR_BLOCK
            if pad:
                self._queue(_ZEROS[:pad])
            placed.append((offset, len(data)))
            record.append((ext, offset, len(data)))
        self.samples.append((key, record))
        return placed

    def finish(self) -> tuple[int, str]:
        """Write the end-of-archive blocks, fsync and publish; return (size, xxh3_128)."""
        self._queue(_ZEROS)
        self._flush()
        try:
            os.close(self._fd)
            self._fd = -1
            publish(self._tmp, self.path, durable=self._durable)
        except OSError as exc:
            self.abort()
            raise storage_error(exc, self.path, "publishing") from exc
        return self._pos, self._hasher.hexdigest()

    def abort(self) -> None:
        """Close and remove the temp file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)


def dali_index_text(samples: Sequence[tuple[str, Sequence[tuple[str, int, int]]]]) -> bytes:
    """Return DALI's webdataset index (v1.2, as its ``wds2idx`` writes) for a tar shard.

    One line per sample: ``ext offset size name`` for each member, offsets of the data.
    """
    lines = [f"v1.2 {len(samples)}"]
    for key, members in samples:
        lines.append(" ".join(f"{ext} {off} {size} {key}.{ext}" for ext, off, size in members))
    return ("\n".join(lines) + "\n").encode("ascii")
