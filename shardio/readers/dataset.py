"""Open a packed dataset (manifest + memory-mapped index) and read members with pread."""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from typing import Any

from shardio.errors import ChecksumMismatchError, FormatError, StorageError
from shardio.format.checksum import hex64, member_xxh3_64
from shardio.format.index import Index
from shardio.format.manifest import Manifest, load_manifest
from shardio.format.spec import LABEL_EXT, MANIFEST_FILENAME

__all__ = ["FilePool", "PackedDataset"]


class FilePool:
    """Open read-only file descriptors, at most ``max_open`` at a time (least recently used
    is closed first). Opens lazily, so it can be created before a fork and used after."""

    def __init__(self, max_open: int = 64) -> None:
        self.max_open = max_open
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._pid = os.getpid()
        self.opens = 0

    def fd(self, path: str) -> int:
        """Return an open descriptor for ``path``."""
        if self._pid != os.getpid():
            # Descriptors inherited over fork are this process's copies: close them and
            # start afresh (pread keeps no offset, but each process owns its pool).
            for inherited in self._fds.values():
                with contextlib.suppress(OSError):
                    os.close(inherited)
            self._fds.clear()
            self._pid = os.getpid()
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise StorageError(exc.errno, f"cannot open shard {path}: {exc.strerror}") from exc
        self.opens += 1
        self._fds[path] = fd
        if len(self._fds) > self.max_open:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd

    def discard(self, path: str) -> None:
        """Close the descriptor of ``path`` if open (after the file was replaced)."""
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close every descriptor."""
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds.clear()


class PackedDataset:
    """A dataset written by ``shardio pack``.

    Args:
        root: the dataset directory (holding manifest.json).
        max_open: bound on shard files held open at once.
    """

    def __init__(self, root: str | os.PathLike[str], *, max_open: int = 64) -> None:
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise FormatError(f"{self.root}: no such dataset directory")
        self.manifest: Manifest = load_manifest(os.path.join(self.root, MANIFEST_FILENAME))
        self.index = Index.open(os.path.join(self.root, self.manifest.index.path))
        if len(self.index) != self.manifest.num_samples:
            raise FormatError(
                f"{self.root}: index holds {len(self.index)} samples, manifest says "
                f"{self.manifest.num_samples}"
            )
        if self.index.n_shards != len(self.manifest.shards):
            raise FormatError(
                f"{self.root}: index refers to {self.index.n_shards} shards, manifest lists "
                f"{len(self.manifest.shards)}"
            )
        self._shard_paths = [os.path.join(self.root, s.path) for s in self.manifest.shards]
        self.pool = FilePool(max_open)

    def __len__(self) -> int:
        return len(self.index)

    def __enter__(self) -> PackedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def shard_path(self, shard: int) -> str:
        """Absolute path of shard number ``shard``."""
        return self._shard_paths[shard]

    def key(self, sample: int) -> str:
        """Key of a sample."""
        return self.index.key(sample)

    def read_member_into(
        self,
        member: int,
        target: memoryview,
        *,
        shard: int,
        sample: int | None = None,
        verify: bool = True,
    ) -> None:
        """Read one member's bytes into ``target`` (its exact size) with preadv, checking its
        xxh3-64.

        Raises:
            ChecksumMismatchError: the bytes differ from the index's checksum.
            StorageError: the shard is missing or short.
        """
        rec = self.index.members[member]
        path = self._shard_paths[shard]
        size = len(target)
        try:
            got = os.preadv(self.pool.fd(path), [target], int(rec["offset"])) if size else 0
        except OSError as exc:
            raise StorageError(exc.errno, f"cannot read shard {path}: {exc.strerror}") from exc
        if sample is None and (got != size or verify):
            sample = self._sample_of(member)
        if got != size:
            raise StorageError(5, f"shard {path} is truncated (sample {self.key(sample or 0)!r})")
        if verify:
            actual = member_xxh3_64(target)
            if actual != int(rec["xxh3_64"]):
                raise ChecksumMismatchError(
                    path=path,
                    shard=self.manifest.shards[shard].path,
                    key=self.key(sample or 0),
                    expected=hex64(int(rec["xxh3_64"])),
                    actual=hex64(actual),
                )

    def read_member(
        self, member: int, *, shard: int, sample: int | None = None, verify: bool = True
    ) -> bytes:
        """Return one member's bytes (see :meth:`read_member_into`)."""
        buf = bytearray(int(self.index.members[member]["size"]))
        self.read_member_into(member, memoryview(buf), shard=shard, sample=sample, verify=verify)
        return bytes(buf)

    def _sample_of(self, member: int) -> int:
        import numpy as np

        return int(np.searchsorted(self.index.samples["first_member"], member, side="right") - 1)

    def read_sample(self, sample: int, *, verify: bool = True) -> dict[str, Any]:
        """Return a sample in the WebDataset convention: ``__key__`` and bytes per extension.

        The label member ``cls`` is returned as an int.
        """
        rec = self.index.samples[sample]
        shard = int(rec["shard"])
        out: dict[str, Any] = {"__key__": self.index.key(sample)}
        exts = self.index.exts
        for m in self.index.sample_member_range(sample):
            ext = exts[int(self.index.members[m]["ext_id"])]
            data = self.read_member(m, shard=shard, sample=sample, verify=verify)
            synthesised = int(self.index.members[m]["path_length"]) == 0
            out[ext] = int(data) if ext == LABEL_EXT and synthesised else data
        return out

    def close(self) -> None:
        """Close shard files and the index mapping."""
        self.pool.close()
        self.index.close()
