"""The exception tree of shardio: every error a caller may want to catch.

::

    ShardioError
    ├── UsageError(ValueError)            bad arguments or options given by the user
    │   └── MissingExtraError(ImportError) an optional extra is not installed (names it)
    ├── SourceError(OSError)              the tree to pack is missing, empty or unreadable
    ├── FormatError(ValueError)           a manifest, index or shard that is malformed or of
    │                                     an unsupported format version
    ├── StorageError(OSError)             reading or writing a dataset failed (ENOSPC, EIO, ...)
    │   ├── CommandNotFoundError          an external command (lfs, beegfs-ctl) is not installed
    │   ├── IntegrityError                bytes on disk differ from what the index promises
    │   │   └── ChecksumMismatchError     one member's or shard's xxh3 does not match
    │   ├── StorageUnavailableError       the storage did not answer (ENXIO, ENOTCONN, ESTALE,
    │   │   │                             ETIMEDOUT, EIO, ...): retryable, ``.retryable``
    │   │   └── ReadStalledError          a read stalled past its deadline and was abandoned
    │   └── SampleUnavailableError        a sample stayed unreadable after every recovery step
    ├── SampleDecodeError(ValueError)     a sample's bytes (checked) cannot be decoded
    └── PackError                         a pack could not complete (strict mode, changed source)

Each branch also inherits the builtin a caller would already catch, so ``except OSError``
sees storage problems and ``except ValueError`` sees malformed input.
"""

from __future__ import annotations

import errno
from typing import Any, TypeVar, overload

__all__ = [
    "CheckpointError",
    "CheckpointUnavailableError",
    "ChecksumMismatchError",
    "CommandNotFoundError",
    "FormatError",
    "IntegrityError",
    "MissingExtraError",
    "NoCheckpointError",
    "PackError",
    "ReadStalledError",
    "SampleDecodeError",
    "SampleUnavailableError",
    "ShardioError",
    "SourceError",
    "StorageError",
    "StorageUnavailableError",
    "UNAVAILABLE_ERRNOS",
    "UsageError",
    "unavailable_error",
    "wrap_os_error",
]


class ShardioError(Exception):
    """Root of every error raised on purpose by shardio."""


class UsageError(ShardioError, ValueError):
    """The caller passed an invalid argument or option."""


# What each extra of pyproject.toml installs, by the package index's names: the install hint
# names these packages, never ``shardio[...]`` (the name shardio on the package index belongs
# to an unrelated project). tests/unit/runtime/test_missing_extras.py keeps it in step.
EXTRA_PACKAGES = {
    "torch": "torch",
    "dali": "nvidia-dali-cuda120",
    "decode": "pillow",
    "metrics": "prometheus-client",
    "plot": "matplotlib",
    "parity": "pyeclib",
    "checkpoint": "zstandard",
}


class MissingExtraError(UsageError, ImportError):
    """An optional dependency is not installed: the message names the package to install and
    the extra of a shardio checkout that holds it.

    Args:
        needs: what needs it ("shardio bench needs PyTorch").
        extra: the extra of ``pip install -e '.[EXTRA]'`` in a shardio checkout.
        detail: why the import failed, when that is not plain absence.
    """

    def __init__(self, needs: str, extra: str, detail: str | None = None) -> None:
        package = EXTRA_PACKAGES.get(extra, extra)
        message = f"{needs}: pip install {package}"
        super().__init__(message if detail is None else f"{message} ({detail})")
        self.needs, self.extra, self.detail = needs, extra, detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.needs, self.extra, self.detail))


class _PlainOSError(OSError):
    """An OSError whose str() is its message alone (no "[Errno N]" prefix for users)."""

    def __str__(self) -> str:
        if self.strerror is not None:
            return str(self.strerror)
        return super().__str__()


class SourceError(ShardioError, _PlainOSError):
    """The source tree of a pack is missing, empty or cannot be read."""


class FormatError(ShardioError, ValueError):
    """A manifest, index or shard is malformed or has an unsupported format version."""


class StorageError(ShardioError, _PlainOSError):
    """Reading or writing dataset files failed.

    Attributes:
        sample_index: the sample being read, when a read failed (in the reading process
            only; not carried by pickling).
    """

    sample_index: int | None = None


# What a distributed filesystem's client returns when a server (data server, metadata server,
# the client daemon itself) is gone or slow: the data may come back, so these are retried.
UNAVAILABLE_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EIO", "ENXIO", "ENOTCONN", "ESTALE", "ETIMEDOUT", "EHOSTDOWN", "EHOSTUNREACH",
        "ECONNRESET", "ECONNREFUSED", "ECONNABORTED", "ENETDOWN", "ENETUNREACH", "ENETRESET",
        "ENOLINK", "EREMOTEIO", "ECOMM", "ESHUTDOWN", "EAGAIN", "EBUSY",
    )
    if hasattr(errno, name)
)  # fmt: skip


class StorageUnavailableError(StorageError):
    """The storage did not answer: a dead or unreachable server, a stale handle, a gone
    mount. The same read may succeed later or from another copy.

    Attributes:
        retryable: always True (what a caller's retry loop can test).
    """

    retryable = True


class ReadStalledError(StorageUnavailableError):
    """A read (or open) stalled past its deadline and was abandoned (``read_timeout_s``), or
    was not attempted because its shard is held unavailable after such a stall; its errno is
    ``ETIMEDOUT``.

    Attributes:
        waited_s: how long the caller waited before abandoning it (0 for a call refused at
            once; in the raising process only, not carried by pickling).
    """

    waited_s: float = 0.0


_OSErrorT = TypeVar("_OSErrorT", bound=OSError)


@overload
def wrap_os_error(exc: OSError, message: str) -> StorageError: ...
@overload
def wrap_os_error(exc: OSError, message: str, kind: type[_OSErrorT]) -> _OSErrorT: ...
def wrap_os_error(exc: OSError, message: str, kind: type[OSError] = StorageError) -> OSError:
    """A ``kind`` (a :class:`StorageError` unless told) for ``exc`` with ``message``: its
    errno, or EIO when it has none (``raise wrap_os_error(exc, ...) from exc``)."""
    return kind(exc.errno or errno.EIO, message)


def unavailable_error(exc: OSError, message: str) -> StorageError:
    """A StorageError for ``exc`` with ``message``: typed :class:`StorageUnavailableError`
    (or :class:`ReadStalledError`) when its errno says the storage did not answer."""
    code = exc.errno if exc.errno else errno.EIO
    if isinstance(exc, ReadStalledError):
        return ReadStalledError(code, message)
    if isinstance(exc, StorageUnavailableError) or code in UNAVAILABLE_ERRNOS:
        return StorageUnavailableError(code, message)
    return StorageError(code, message)


class CommandNotFoundError(StorageError):
    """An external command needed for a filesystem operation is not installed."""


class PackError(ShardioError):
    """A pack could not complete."""


class IntegrityError(StorageError):
    """Bytes on disk do not match the index or manifest."""


class ChecksumMismatchError(IntegrityError):
    """A member's or shard's xxh3 checksum does not match the recorded one.

    Attributes:
        path: the shard file that was read.
        shard: the shard's name as listed in the manifest.
        key: the sample key, or ``None`` for a whole-shard checksum.
        expected: the recorded checksum, as hex.
        actual: the checksum of the bytes read, as hex.
    """

    def __init__(
        self,
        *,
        path: str,
        shard: str,
        key: str | None,
        expected: str,
        actual: str,
        member: str | None = None,
    ) -> None:
        what = f"sample {key!r}" if key is not None else "shard"
        if member is not None:
            what = f"{what}, member {member!r}" if key is not None else f"member {member!r}"
        super().__init__(
            f"checksum mismatch in {path} ({what}): expected xxh3 {expected}, got {actual}"
        )
        self.path = path
        self.shard = shard
        self.key = key
        self.expected = expected
        self.actual = actual
        self.member = member

    def __reduce__(self) -> tuple[Any, ...]:
        # OSError subclasses pickle by positional args; rebuild from keywords so the error
        # survives the trip from a DataLoader worker to the main process.
        return (
            _rebuild_checksum_error,
            (self.path, self.shard, self.key, self.expected, self.actual, self.member),
        )


def _rebuild_checksum_error(  # noqa: PLR0917 - pickle passes positionally
    path: str, shard: str, key: str | None, expected: str, actual: str, member: str | None
) -> ChecksumMismatchError:
    return ChecksumMismatchError(
        path=path, shard=shard, key=key, expected=expected, actual=actual, member=member
    )


class CheckpointError(StorageError):
    """A checkpoint could not be saved, or one found is damaged, incomplete or not this job's
    to load (another layout of ranks). A background save's failure is raised by the
    :class:`~shardio.checkpoint.Checkpointer`'s next call, with the original as ``__cause__``."""


class CheckpointUnavailableError(CheckpointError, StorageUnavailableError):
    """A checkpoint (or the directory of them) could not be read now: a server down, a read
    or listing past its deadline, a permission refused. Not "damaged" and not "none": the
    caller retries later, never starts afresh (``retryable`` is True)."""


class NoCheckpointError(CheckpointError):
    """There is no checkpoint (of the kind asked) to load: the one case where restart code
    starts afresh. Checkpoints that exist but are all damaged raise a plain
    :class:`CheckpointError`; ones that cannot be read now a :class:`CheckpointUnavailableError`.

    Attributes:
        skipped: ``[(path, reason), ...]`` (empty: none was found).
    """

    def __init__(self, message: str, skipped: list[tuple[str, str]] | None = None) -> None:
        super().__init__(errno.ENOENT, message)
        self.skipped = list(skipped or [])

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.skipped))


class SampleUnavailableError(StorageError):
    """A sample could not be read after every recovery step (retries, re-staging, rebuilding)
    and the policy is ``raise``, or no substitute could be read under ``skip``.

    Attributes:
        shard: the shard's name as listed in the manifest.
        key: the sample's key.
        sample: the sample's index.
        tried: what was tried, in order, each with its outcome.
    """

    def __init__(
        self, message: str, *, shard: str, key: str, sample: int, tried: tuple[str, ...]
    ) -> None:
        super().__init__(5, message)  # EIO
        self.shard = shard
        self.key = key
        self.sample = sample
        self.tried = tried

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_unavailable,
            (str(self.strerror), self.shard, self.key, self.sample, self.tried),
        )


def _rebuild_unavailable(
    message: str, shard: str, key: str, sample: int, tried: tuple[str, ...]
) -> SampleUnavailableError:
    return SampleUnavailableError(message, shard=shard, key=key, sample=sample, tried=tried)


class SampleDecodeError(ShardioError, ValueError):
    """A sample's bytes passed their checksum but its decoder failed on them (a corrupt image
    packed as it was, or a decoder that raised). A ``recovery=`` policy treats it like an
    unreadable sample: ``skip`` substitutes it, ``raise`` raises this.

    Attributes:
        dataset: the dataset directory.
        shard: the shard's name as listed in the manifest.
        key: the sample's key.
        sample: the sample's index.
        field: the extension the decoder failed on, when known.
        sample_index: ``sample`` again (what recovery looks for on any read error).
    """

    def __init__(
        self,
        message: str,
        *,
        dataset: str,
        shard: str,
        key: str,
        sample: int,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.dataset = dataset
        self.shard = shard
        self.key = key
        self.sample = sample
        self.field = field
        self.sample_index: int | None = sample

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_decode_error,
            (str(self), self.dataset, self.shard, self.key, self.sample, self.field),
        )


def _rebuild_decode_error(  # noqa: PLR0917 - pickle passes positionally
    message: str, dataset: str, shard: str, key: str, sample: int, field: str | None
) -> SampleDecodeError:
    return SampleDecodeError(
        message, dataset=dataset, shard=shard, key=key, sample=sample, field=field
    )
