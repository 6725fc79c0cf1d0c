"""A fault-injecting opener, for tests and for fault drills on a real cluster.

``FaultyOpener([Fault(kind="flip", path="shard-000003", offset=4096)])`` behaves like the
POSIX opener except on the files whose path contains ``path``: there it flips bytes,
pretends the file is shorter, fails with ``EIO`` (always, intermittently, or once a number of
bytes was read), returns short reads, sleeps, reports the file missing, or serves other
bytes as if the file had been replaced. Faults are plain frozen data, so the opener pickles
into DataLoader workers; each process counts ``times`` and ``after_bytes`` for itself.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import time
from dataclasses import dataclass, field

from shardio.errors import UsageError
from shardio.storage.opener import PosixOpener, copy_through_buffer

__all__ = ["FAULT_KINDS", "Fault", "FaultyOpener"]

FAULT_KINDS = (
    "flip", "truncate", "eio", "eio_after", "short", "slow", "missing", "replaced", "hang",
    "hang_open",
)  # fmt: skip
_HANG_POLL_S = 0.02


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault.

    Args:
        kind: "flip" (XOR the byte at ``offset`` with 0xFF), "truncate" (the file seems
            ``offset`` bytes long), "eio" (reads fail with EIO, with ``probability``),
            "eio_after" (reads fail once ``after_bytes`` were read from matching files),
            "short" (each read returns at most half of what was asked, at least 1 byte),
            "slow" (each read sleeps ``delay_s``), "missing" (opening fails with ENOENT),
            "replaced" (reads return other bytes, as a file replaced under its name), "hang"
            (a read blocks, as on a dead data server, for ``delay_s`` or an hour when 0, or
            until the file ``release`` exists), "hang_open" (the same for opening).
        path: a substring of the paths it hits ("" hits every file).
        offset: the byte flipped, or the apparent size for "truncate".
        after_bytes: for "eio_after".
        times: how often it fires in one process (None: every time).
        probability: for "eio": the chance that a read fails (seeded by ``seed``).
        seed: the seed of "eio"'s draws.
        delay_s: for "slow", "hang" and "hang_open".
        release: for "hang" and "hang_open": a path whose existence ends the hang (any
            process may create it).
    """

    kind: str
    path: str = ""
    offset: int = 0
    after_bytes: int = 0
    times: int | None = None
    probability: float = 1.0
    seed: int = 0
    delay_s: float = 0.0
    release: str = ""

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise UsageError(f"unknown fault kind {self.kind!r}: one of {', '.join(FAULT_KINDS)}")
        if self.offset < 0 or self.after_bytes < 0 or self.delay_s < 0:
            raise UsageError(f"fault {self.kind}: offset, after_bytes and delay_s must be >= 0")
        if not 0.0 <= self.probability <= 1.0:
            raise UsageError(f"fault {self.kind}: probability must lie in [0, 1]")
        if self.times is not None and self.times < 0:
            raise UsageError(f"fault {self.kind}: times must be >= 0")


@dataclass
class _State:
    fired: list[int]
    bytes_read: int = 0
    reads: int = 0


@dataclass
class FaultyOpener(PosixOpener):
    """The POSIX opener with :class:`Fault`s applied to matching paths.

    Attributes:
        faults: the faults, checked in order.
        fired: per fault, how often it fired in this process.
    """

    faults: list[Fault] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._paths: dict[int, str] = {}
        self._state = _State([0] * len(self.faults))
        self._pid = os.getpid()

    @property
    def fired(self) -> list[int]:
        """How often each fault fired in this process."""
        return list(self._local().fired)

    def _local(self) -> _State:
        if self._pid != os.getpid():  # a forked worker counts for itself
            self._state = _State([0] * len(self.faults))
            self._pid = os.getpid()
        return self._state

    def __getstate__(self) -> dict[str, object]:
        return {"faults": self.faults}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.faults = list(state["faults"])  # type: ignore[call-overload]
        self.__post_init__()

    def _hits(self, path: str, *kinds: str) -> list[tuple[int, Fault]]:
        state = self._local()
        return [
            (i, f)
            for i, f in enumerate(self.faults)
            if f.kind in kinds and f.path in path and (f.times is None or state.fired[i] < f.times)
        ]

    def _fire(self, i: int) -> None:
        self._local().fired[i] += 1

    def _hang(self, path: str, kind: str) -> None:
        for i, f in self._hits(path, kind):
            self._fire(i)
            end = time.monotonic() + (f.delay_s or 3600.0)
            while time.monotonic() < end and not (f.release and os.path.exists(f.release)):
                time.sleep(_HANG_POLL_S)

    def open(self, path: str, *, nofollow: bool = False) -> int:
        self._hang(path, "hang_open")
        for i, _f in self._hits(path, "missing"):
            self._fire(i)
            raise FileNotFoundError(errno.ENOENT, f"injected: {path} is missing", path)
        fd = super().open(path, nofollow=nofollow)
        self._paths[fd] = path
        return fd

    def dup(self, fd: int, path: str) -> int:
        new = super().dup(fd, path)
        self._paths[new] = path  # its faults apply to the duplicate too
        return new

    def close(self, fd: int) -> None:
        self._paths.pop(fd, None)
        super().close(fd)

    def _apparent_size(self, path: str, real: int) -> int:
        for i, f in self._hits(path, "truncate"):
            self._fire(i)
            real = min(real, f.offset)
        return real

    def size(self, fd: int) -> int:
        real = super().size(fd)
        return self._apparent_size(self._paths.get(fd, ""), real)

    def pread_into(self, fd: int, target: memoryview, offset: int) -> int:
        path = self._paths.get(fd, "")
        state = self._local()
        state.reads += 1
        for i, f in self._hits(path, "slow"):
            self._fire(i)
            time.sleep(f.delay_s)
        self._hang(path, "hang")
        for i, f in self._hits(path, "eio"):
            draw = random.Random(f"{f.seed}:{path}:{offset}:{state.reads}").random()
            if draw < f.probability:
                self._fire(i)
                raise OSError(errno.EIO, f"injected EIO reading {path} at {offset}")
        for i, f in self._hits(path, "eio_after"):
            if state.bytes_read >= f.after_bytes:
                self._fire(i)
                raise OSError(errno.EIO, f"injected EIO reading {path} at {offset}")
        want = len(target)
        for i, _f in self._hits(path, "short"):
            if want > 1:
                self._fire(i)
                want = max(1, want // 2)
        limit = self._apparent_size(path, offset + want) if path else offset + want
        want = max(0, min(want, limit - offset))
        got = super().pread_into(fd, target[:want], offset) if want else 0
        state.bytes_read += got
        for i, f in self._hits(path, "flip"):
            if offset <= f.offset < offset + got:
                self._fire(i)
                target[f.offset - offset] ^= 0xFF
        for i, _f in self._hits(path, "replaced"):
            if got:
                self._fire(i)
                for k in range(0, got, 512):
                    target[k] ^= 0x5A
        return got

    def copy_into(self, fd: int, out: int, offset: int, count: int) -> int:
        """Through :meth:`pread_into`, so that a copy meets the faults a read meets."""
        return copy_through_buffer(self, fd, out, offset, count)

    def map(self, path: str) -> mmap.mmap | None:
        """A mapping of the bytes this opener would read (faults applied), in anonymous
        memory."""
        fd = self.open(path)
        try:
            size = self.size(fd)
            if size == 0:
                return None
            mm = mmap.mmap(-1, size)
            got = 0
            view = memoryview(mm)
            try:
                while got < size:
                    n = self.pread_into(fd, view[got:], got)
                    if n == 0:
                        break
                    got += n
            finally:
                view.release()
            return mm
        finally:
            self.close(fd)

    def __repr__(self) -> str:
        return f"FaultyOpener({self.faults!r})"
