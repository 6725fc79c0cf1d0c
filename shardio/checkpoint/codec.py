"""One rank's state to bytes on disk and back: ``torch.save``, Zstandard, xxh3-128.

Writing streams: ``torch.save`` writes into a Zstandard compressor (multi-threaded where
there are cores) that writes into the file, hashing every byte on its way to disk, so a
10 GB state is never held twice in memory. Reading streams too, and hands nothing on before
the last byte read has matched the manifest's hash: the bytes are read once, hashed and
decompressed as they come, and only once the digest matches are they given to
``torch.load`` (``weights_only`` by default: a checkpoint cannot run code; numpy arrays and
scalars of plain dtypes are allowed, see ``loadable``).

Level 1 and the whole stream compressed: measured here (benchmarks/RESULTS.md,
"Checkpoints"), level 3 saves under 0.1% more on weights at 0.6x the speed; the loader's
state and other small values compress 20x and more at any level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import os
from collections.abc import Callable
from typing import Any

import xxhash

from shardio.errors import (
    CheckpointError,
    IntegrityError,
    MissingExtraError,
    ShardioError,
    StorageError,
    wrap_os_error,
)
from shardio.storage.stall import IoThreads, call_with_deadline

__all__ = [
    "DEFAULT_LEVEL",
    "Written",
    "check_file",
    "load_zstandard",
    "read_payload",
    "write_payload",
]

DEFAULT_LEVEL = 1
MAX_LEVEL = 19  # beyond this zstd needs far more memory than a checkpoint should
_CHUNK = 4 << 20


def load_zstandard() -> Any:
    """The ``zstandard`` module, or a MissingExtraError naming the ``checkpoint`` extra."""
    try:
        import zstandard
    except ModuleNotFoundError as exc:
        raise MissingExtraError(
            "compressed checkpoints need zstandard", "checkpoint", "or compression='none'"
        ) from exc
    return zstandard


@dataclasses.dataclass(frozen=True)
class Written:
    """What :func:`write_payload` wrote: bytes on disk, their hash, bytes before compression."""

    size_bytes: int
    xxh3_128: str
    raw_bytes: int


class _FileSink:
    """Buffered writes to a descriptor, hashing every byte written."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path
        self.hasher = xxhash.xxh3_128()
        self.size = 0
        self.buffer = bytearray()
        self.failure: StorageError | None = None  # torch's writer may hide it in its own

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if len(self.buffer) + len(data) < _CHUNK:
            self.buffer += data
            return len(data)
        self._drain()
        self._write_all(data)  # a large write goes out as it is, not copied
        return len(data)

    def _write_all(self, data: bytes | bytearray | memoryview) -> None:
        whole = memoryview(data)
        view = whole.cast("B") if whole.ndim != 1 or whole.format != "B" else whole
        total, done = view.nbytes, 0
        failure: OSError | None = None
        try:
            while done < total:
                done += os.write(self.fd, view[done:])
            self.hasher.update(view)
        except OSError as exc:
            failure = exc
        finally:  # released before raising: the buffer behind them is cleared later
            view.release()
            whole.release()
        if failure is not None:
            self.failure = _write_error(failure, self.path)
            raise self.failure from failure
        self.size += total

    def _drain(self) -> None:
        if self.buffer:
            self._write_all(self.buffer)
            self.buffer.clear()

    def flush(self) -> None:
        self._drain()


class _Counting:
    """What ``torch.save`` writes to: counts the raw bytes and passes them on."""

    def __init__(self, out: Any) -> None:
        self.out, self.count = out, 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.count += len(data)
        self.out.write(data)
        return len(data)

    def flush(self) -> None:
        self.out.flush()


def _write_error(exc: OSError, path: str) -> StorageError:
    if exc.errno == errno.ENOSPC:
        return StorageError(exc.errno, f"no space left on device while writing checkpoint {path}")
    if exc.errno == errno.EDQUOT:
        return StorageError(exc.errno, f"disk quota exceeded while writing checkpoint {path}")
    return wrap_os_error(exc, f"writing checkpoint {path} failed: {exc}")


def write_payload(fd: int, path: str, obj: Any, *, level: int | None, threads: int) -> Written:
    """``torch.save(obj)`` into ``fd``, compressed at ``level`` (None: not compressed).

    Raises:
        StorageError: a write failed (ENOSPC named as such).
    """
    import torch

    sink = _FileSink(fd, path)
    try:
        if level is None:
            counting = _Counting(sink)
            torch.save(obj, counting)  # type: ignore[arg-type]  # a writable stream
        else:
            zstandard = load_zstandard()
            compressor = zstandard.ZstdCompressor(
                level=level, threads=threads, write_checksum=False
            )
            with compressor.stream_writer(sink, closefd=False, write_return_read=True) as packed:
                counting = _Counting(packed)
                torch.save(obj, counting)  # type: ignore[arg-type]  # a writable stream
        sink.flush()
    except ShardioError:
        raise
    except Exception as exc:  # torch.save refused the state (an object it cannot pickle)
        if sink.failure is not None:  # a write failed under torch's writer, which rewords it
            raise sink.failure from exc
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            errno.EINVAL, f"cannot save the state into {path}: {type(exc).__name__}: {first}"
        ) from exc
    return Written(sink.size, sink.hasher.hexdigest(), counting.count)


class _VerifyingReader:
    """Reads a file once, by chunks read under a deadline, hashing what it reads."""

    def __init__(self, fd: int, path: str, size: int, read: Callable[[int, int], bytes]) -> None:
        self.fd, self.path, self.size, self.pread = fd, path, size, read
        self.offset = 0
        self.hasher = xxhash.xxh3_128()

    def read(self, n: int = -1) -> bytes:
        want = self.size - self.offset if n is None or n < 0 else min(n, self.size - self.offset)
        if want <= 0:
            return b""
        data = self.pread(want, self.offset)
        if not data:
            raise IntegrityError(
                errno.EIO, f"checkpoint file {self.path} is shorter than its manifest says"
            )
        self.offset += len(data)
        self.hasher.update(data)
        return data

    def finish(self, expected: str) -> None:
        while self.read(_CHUNK):  # bytes past the stream's end are hashed too
            pass
        if self.hasher.hexdigest() != expected:
            raise IntegrityError(
                errno.EIO, f"checkpoint file {self.path} does not match its xxh3-128"
            )


def _deadline_pread(
    fd: int, path: str, timeout_s: float, pool: IoThreads
) -> Callable[[int, int], bytes]:
    def pread(n: int, offset: int) -> bytes:
        try:
            data: bytes = call_with_deadline(
                pool, lambda: os.pread(fd, min(n, _CHUNK), offset), timeout_s,
                f"reading checkpoint file {path}",
            )  # fmt: skip
        except StorageError:
            raise
        except OSError as exc:
            raise wrap_os_error(exc, f"reading {path} failed: {exc}") from exc
        return data

    return pread


def _open_sized(path: str, size_bytes: int) -> int:
    from shardio.storage.files import open_regular

    fd = open_regular(path, what="checkpoint file", nofollow=True)
    try:
        actual = os.fstat(fd).st_size
    except OSError as exc:
        os.close(fd)
        raise wrap_os_error(exc, f"cannot stat {path}: {exc}") from exc
    if actual != size_bytes:
        os.close(fd)
        raise IntegrityError(
            errno.EIO,
            f"checkpoint file {path} has {actual:,} bytes, its manifest says {size_bytes:,}",
        )
    return fd


def check_file(
    path: str, *, size_bytes: int, xxh3_128: str, timeout_s: float, pool: IoThreads,
    uncached: bool = False,
) -> None:  # fmt: skip
    """Read ``path`` whole and check its size and xxh3-128 (no torch, nothing decoded).

    Args:
        uncached: drop the file's cached pages first (where the kernel does), so that what
            is checked is what the storage holds, not what this process just wrote.

    Raises:
        IntegrityError: wrong size or bytes. ReadStalledError: a read stalled.
        StorageError: it cannot be opened or read.
    """
    fd = _open_sized(path, size_bytes)
    try:
        if uncached:
            with contextlib.suppress(OSError):
                os.fdatasync(fd)  # written pages must be clean to be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        reader = _VerifyingReader(fd, path, size_bytes, _deadline_pread(fd, path, timeout_s, pool))
        reader.finish(xxh3_128)
    finally:
        os.close(fd)


def read_payload(
    path: str,
    *,
    size_bytes: int,
    raw_bytes: int,
    xxh3_128: str,
    compression: str,
    timeout_s: float,
    pool: IoThreads,
    weights_only: bool,
    map_location: Any,
) -> Any:
    """Read, verify and load one rank's file.

    Raises:
        IntegrityError: the file's size or bytes do not match the manifest, or it does not
            decompress to ``raw_bytes``.
        CheckpointError: it is intact but ``torch.load`` refused it (``weights_only``).
        ReadStalledError: a read stalled past ``timeout_s``.
        StorageError: it cannot be opened or read.
    """
    import torch

    fd = _open_sized(path, size_bytes)
    try:
        reader = _VerifyingReader(fd, path, size_bytes, _deadline_pread(fd, path, timeout_s, pool))
        out = io.BytesIO()
        if compression == "none":
            while chunk := reader.read(_CHUNK):
                out.write(chunk)
        else:
            zstandard = load_zstandard()
            try:
                with zstandard.ZstdDecompressor().stream_reader(
                    reader, read_size=_CHUNK, closefd=False
                ) as unpacked:
                    while chunk := unpacked.read(_CHUNK):
                        out.write(chunk)
                        if out.tell() > raw_bytes:
                            break
            except zstandard.ZstdError as exc:
                raise IntegrityError(
                    errno.EIO, f"checkpoint file {path} does not decompress: {exc}"
                ) from None
        reader.finish(xxh3_128)
        if out.tell() != raw_bytes:
            raise IntegrityError(
                errno.EIO,
                f"checkpoint file {path} holds {out.tell():,} bytes of state, its manifest "
                f"says {raw_bytes:,}",
            )
    finally:
        os.close(fd)
    out.seek(0)
    from shardio.checkpoint.loadable import safe_loading

    try:
        # numpy arrays and scalars of plain dtypes load too (a save lets nothing else
        # through); a sparse tensor's indices are checked (else unchecked, with a warning)
        with (
            safe_loading() if weights_only else contextlib.nullcontext(),
            torch.sparse.check_sparse_tensor_invariants(),  # type: ignore[no-untyped-call]
        ):
            return torch.load(out, weights_only=weights_only, map_location=map_location)
    except Exception as exc:  # verified bytes that torch will not load: say which and why
        hint = (
            " (it holds objects weights_only=True refuses: load with weights_only=False, "
            "only a checkpoint you trust)"
            if weights_only
            else ""
        )
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            errno.EINVAL, f"checkpoint file {path} is intact but torch.load failed: {first}{hint}"
        ) from exc
