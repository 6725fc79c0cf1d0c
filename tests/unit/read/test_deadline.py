"""The read deadline (DeadlineOpener), the node registry of held shards, the typed errnos."""

from __future__ import annotations

import errno
import math
import os
import pathlib
import pickle
import threading
import time
from typing import Any

import pytest

import shardio
from shardio.errors import (
    ReadStalledError,
    StorageError,
    StorageUnavailableError,
    UsageError,
    unavailable_error,
)
from shardio.read.deadline import AbandonedBufferError, DeadlineOpener, into_fresh_buffers
from shardio.read.faults import Fault, FaultyOpener
from shardio.read.reader import ShardReader
from shardio.read.setup import with_deadline
from shardio.read.timeouts import (
    DEFAULT_NETWORK_TIMEOUT_S,
    check_read_timeout,
    resolve_read_timeout,
)
from shardio.read.unavailable import UnavailableShards
from shardio.storage.opener import PosixOpener
from shardio.storage.stall import IoThreads, call_with_deadline


@pytest.fixture
def shard(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "shard-000001.tar"
    path.write_bytes(bytes(range(256)) * 64)
    return path


def _hang(path: pathlib.Path, release: pathlib.Path, kind: str = "hang") -> FaultyOpener:
    return FaultyOpener([Fault(kind=kind, path=path.name, release=str(release))])


def _registry(tmp_path: pathlib.Path, scope: str | None = "ds", hold_s: float = 60) -> Any:
    (tmp_path / "shm").mkdir(exist_ok=True)
    return UnavailableShards(scope, hold_s=hold_s, root=str(tmp_path / "shm"))


@pytest.mark.parametrize(
    "bad", [True, False, "5", math.nan, math.inf, -math.inf, -1, -0.5, 86_401, 1e300, [5]]
)
def test_bad_deadlines_are_refused_in_one_line(bad: object) -> None:
    with pytest.raises(UsageError) as info:
        check_read_timeout(bad)
    assert "read_timeout_s" in str(info.value)
    assert "\n" not in str(info.value)


def test_deadline_values() -> None:
    assert check_read_timeout(None) is None
    assert check_read_timeout(0) == 0.0
    assert check_read_timeout(5) == 5.0
    assert check_read_timeout(0.25) == 0.25
    with pytest.raises(UsageError):
        DeadlineOpener(timeout_s=0)


def test_default_is_none_on_local_disk(tmp_path: pathlib.Path) -> None:
    assert resolve_read_timeout(tmp_path, None) == 0.0
    assert resolve_read_timeout(tmp_path, 3) == 3.0
    assert with_deadline(None, 0.0) is None
    assert DEFAULT_NETWORK_TIMEOUT_S == 120.0


def test_errnos_of_a_distributed_filesystem_are_typed_and_retryable() -> None:
    for name in ("ENXIO", "ENOTCONN", "ESTALE", "ETIMEDOUT", "EIO", "EHOSTDOWN", "ECONNRESET",
                 "ENOLINK", "EREMOTEIO"):  # fmt: skip
        code = getattr(errno, name)
        err = unavailable_error(OSError(code, "x"), f"cannot read shard s ({name})")
        assert isinstance(err, StorageUnavailableError), name
        assert isinstance(err, StorageError) and isinstance(err, OSError)
        assert err.retryable is True
        assert err.errno == code
    plain = unavailable_error(OSError(errno.EACCES, "x"), "denied")
    assert type(plain) is StorageError
    assert issubclass(ReadStalledError, StorageUnavailableError)
    for name in ("StorageUnavailableError", "ReadStalledError"):
        assert name in shardio.__all__
        assert getattr(shardio, name) is getattr(shardio.errors, name)
    stalled = pickle.loads(pickle.dumps(ReadStalledError(errno.ETIMEDOUT, "stalled for 5 s")))
    assert isinstance(stalled, ReadStalledError)
    assert str(stalled) == "stalled for 5 s"


def test_a_stalled_read_is_abandoned_and_never_writes_the_buffer(
    shard: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    release = tmp_path / "release"
    opener = DeadlineOpener(_hang(shard, release), timeout_s=0.2, registry=_registry(tmp_path))
    fd = opener.open(str(shard))
    target = bytearray(b"\xaa" * 1000)
    with pytest.raises(ReadStalledError) as info:
        opener.pread_into(fd, memoryview(target), 0)
    assert str(shard) in str(info.value)
    assert "stalled for 0.2 s" in str(info.value)
    assert info.value.errno == errno.ETIMEDOUT
    assert info.value.waited_s >= 0.2
    assert opener.stalls == 1 and opener.abandoned == 1
    # The read completes after its caller gave up: the buffer (a ring slot) stays as it was.
    release.touch()
    deadline = time.monotonic() + 10
    while opener.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert opener.abandoned == 0
    assert target == bytearray(b"\xaa" * 1000)
    # Held: the next read of that file fails at once, not after another deadline.
    with pytest.raises(ReadStalledError, match="held unavailable"):
        opener.pread_into(fd, memoryview(target), 0)
    assert opener.held_fails == 1
    opener.close(fd)


def test_reads_that_answer_are_exact(shard: pathlib.Path) -> None:
    opener = DeadlineOpener(PosixOpener(), timeout_s=5)
    fd = opener.open(str(shard))
    try:
        assert opener.size(fd) == shard.stat().st_size
        assert opener.identity(fd) == (shard.stat().st_dev, shard.stat().st_ino)
        opener.advise(fd, 0, 100)
        for offset, size in ((0, 10), (1000, 5000), (16000, 1000)):
            buf = bytearray(size)
            got = opener.pread_into(fd, memoryview(buf), offset)
            assert bytes(buf[:got]) == shard.read_bytes()[offset : offset + size]
        mapped = opener.map(str(shard))
        assert mapped is not None and mapped[:256] == bytes(range(256))
        mapped.close()
    finally:
        opener.close(fd)


def test_concurrent_callers_do_not_queue_behind_a_stall(
    shard: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    other = tmp_path / "shard-000002.tar"
    other.write_bytes(b"y" * 4096)
    release = tmp_path / "release"
    opener = DeadlineOpener(_hang(shard, release), timeout_s=5, registry=_registry(tmp_path))
    stuck_fd, fine_fd = opener.open(str(shard)), opener.open(str(other))
    errors: list[BaseException] = []

    def stuck() -> None:
        try:
            opener.pread_into(stuck_fd, memoryview(bytearray(10)), 0)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=stuck)
    thread.start()
    buf = bytearray(4096)
    assert opener.pread_into(fine_fd, memoryview(buf), 0) == 4096  # not behind the stall
    release.touch()
    thread.join(timeout=10)
    assert not thread.is_alive() and errors == []


def test_abandoned_calls_are_capped(shard: pathlib.Path, tmp_path: pathlib.Path) -> None:
    release = tmp_path / "release"
    registry = _registry(tmp_path, hold_s=0)  # no hold: every read stalls again
    opener = DeadlineOpener(
        _hang(shard, release), timeout_s=0.05, registry=registry, max_abandoned=2
    )
    fd = opener.open(str(shard))
    for _ in range(2):
        with pytest.raises(ReadStalledError, match="stalled for"):
            opener.pread_into(fd, memoryview(bytearray(10)), 0)
    began = time.monotonic()
    with pytest.raises(ReadStalledError, match="2 calls of this process are still stalled"):
        opener.pread_into(fd, memoryview(bytearray(10)), 0)
    assert time.monotonic() - began < 0.05 * 20  # at once, no third thread
    release.touch()


def test_a_hung_open_is_abandoned_and_its_descriptor_closed(
    shard: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    release = tmp_path / "release"
    opener = DeadlineOpener(
        _hang(shard, release, "hang_open"), timeout_s=0.1, registry=_registry(tmp_path)
    )
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ReadStalledError, match=f"opening {shard}.*stalled for 0.1 s"):
        opener.open(str(shard))
    release.touch()
    deadline = time.monotonic() + 10
    while opener.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert len(os.listdir("/proc/self/fd")) <= before  # the late descriptor was closed


def test_the_opener_pickles_and_a_forked_child_gets_its_own_threads(
    shard: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    opener = DeadlineOpener(PosixOpener(), timeout_s=2, registry=_registry(tmp_path))
    fd = opener.open(str(shard))
    copy = pickle.loads(pickle.dumps(opener))
    assert copy.timeout_s == 2 and copy.registry.scope == "ds"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            buf = bytearray(256)
            child_fd = opener.open(str(shard))
            ok = opener.pread_into(child_fd, memoryview(buf), 0) == 256 and buf == bytes(range(256))
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.close(read)
    assert os.waitpid(pid, 0)[1] == 0
    opener.close(fd)


def test_the_registry_is_shared_by_the_processes_of_the_node(tmp_path: pathlib.Path) -> None:
    registry = _registry(tmp_path)
    assert registry.held("/pfs/ds/shard-000003.tar") is None
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        _registry(tmp_path).mark("/pfs/ds/shard-000003.tar")
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    time.sleep(0.6)  # the registry is re-read at most twice a second
    left = registry.held("/pfs/ds/shard-000003.tar")
    assert left is not None and 0 < left <= 60
    assert registry.held("/pfs/ds/shard-000004.tar") is None
    # Another dataset's scope does not see it.
    assert _registry(tmp_path, scope="other").held("/pfs/ds/shard-000003.tar") is None
    top = tmp_path / "shm" / f"shardio-unavailable-{os.getuid()}"
    assert top.stat().st_mode & 0o777 == 0o700


def test_a_release_ends_the_hold_on_the_whole_node(tmp_path: pathlib.Path) -> None:
    """A shard rebuilt on a live server is released: the process that rebuilt it and, at
    their next look, the others of the node read it again."""
    here, there = _registry(tmp_path), _registry(tmp_path)
    here.mark("/pfs/ds/shard-000003.tar")
    here.mark("/pfs/ds/shard-000004.tar")
    time.sleep(0.6)
    assert there.held("/pfs/ds/shard-000003.tar") is not None
    here.release("/pfs/ds/shard-000003.tar")
    assert here.held("/pfs/ds/shard-000003.tar") is None
    time.sleep(0.6)
    assert there.held("/pfs/ds/shard-000003.tar") is None
    assert there.held("/pfs/ds/shard-000004.tar") is not None  # the other stays held
    alone = _registry(tmp_path, scope=None)  # no node registry: this process only
    alone.mark("/x")
    time.sleep(0.6)
    assert alone.held("/x") is not None
    alone.release("/x")
    assert alone.held("/x") is None


def test_trying_held_reads_a_held_path_under_the_same_deadline(
    tmp_path: pathlib.Path, shard: pathlib.Path
) -> None:
    opener = DeadlineOpener(timeout_s=5, registry=_registry(tmp_path))
    opener.registry.mark(str(shard))
    with pytest.raises(ReadStalledError, match="not attempted"):
        opener.open(str(shard))
    trying = opener.trying_held()
    fd = trying.open(str(shard))
    try:
        assert trying.pread_into(fd, memoryview(bytearray(16)), 0) == 16
    finally:
        trying.close(fd)
    assert trying.timeout_s == opener.timeout_s and trying.registry is opener.registry
    with pytest.raises(ReadStalledError):
        opener.open(str(shard))  # the opener itself still refuses it


def test_the_registry_expires(tmp_path: pathlib.Path) -> None:
    now = [1000.0]
    registry = UnavailableShards("ds", hold_s=10, root=str(tmp_path), clock=lambda: now[0])
    registry.mark("/a")
    assert registry.held("/a") == 10
    now[0] += 11
    assert registry.held("/a") is None


def test_a_foreign_or_symlinked_registry_is_not_used(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "shm"
    root.mkdir(exist_ok=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (root / f"shardio-unavailable-{os.getuid()}").symlink_to(elsewhere)
    registry = UnavailableShards("ds", hold_s=60, root=str(root))
    registry.mark("/a")
    assert registry.held("/a") is not None  # still held in this process
    assert list(elsewhere.iterdir()) == []  # nothing written through the link
    os.unlink(root / f"shardio-unavailable-{os.getuid()}")
    (root / f"shardio-unavailable-{os.getuid()}").mkdir(mode=0o755)
    os.chmod(root / f"shardio-unavailable-{os.getuid()}", 0o755)
    shared = UnavailableShards("ds", hold_s=60, root=str(root))
    shared.mark("/b")
    assert not any((root / f"shardio-unavailable-{os.getuid()}").iterdir())


def test_planted_entries_are_ignored(tmp_path: pathlib.Path) -> None:
    registry = _registry(tmp_path)
    registry.mark("/real")
    directory = next((tmp_path / "shm" / f"shardio-unavailable-{os.getuid()}").iterdir())
    (directory / "junk").write_bytes(b"\xff" * 100)
    (directory / "big").write_bytes(b"{" + b" " * 100_000)
    (directory / "link").symlink_to("/etc/passwd")
    os.mkfifo(directory / "fifo")
    fresh = _registry(tmp_path)
    assert fresh.held("/real") is not None
    assert fresh.held("/etc/passwd") is None


def test_call_with_deadline_and_close() -> None:
    pool = IoThreads(4)
    assert call_with_deadline(pool, lambda: 7, 1.0, "a call") == 7
    gate = threading.Event()
    with pytest.raises(ReadStalledError, match=r"a slow call stalled for 0\.05 s"):
        call_with_deadline(pool, lambda: gate.wait(5), 0.05, "a slow call")
    gate.set()
    pool.close()


class _EnxioOpener(PosixOpener):
    def pread_into(self, fd: int, target: memoryview, offset: int) -> int:
        raise OSError(errno.ENXIO, "No such device or address")


def test_packed_reads_raise_typed_errors(packed_small: Any, tmp_path: pathlib.Path) -> None:
    root = packed_small("tar")[0]
    with (
        ShardReader(root, opener=_EnxioOpener()) as ds,
        pytest.raises(StorageUnavailableError) as info,
    ):
        ds.read_sample(0)
    assert info.value.errno == errno.ENXIO
    assert "cannot read shard" in str(info.value)
    assert info.value.sample_index == 0
    release = tmp_path / "release"
    with ShardReader(root) as probe:
        name = probe.manifest.shards[0].path
    opener = DeadlineOpener(
        FaultyOpener([Fault(kind="hang", path=name, release=str(release))]),
        timeout_s=0.2,
        registry=_registry(tmp_path),
    )
    try:
        with ShardReader(root, opener=opener) as ds:
            with pytest.raises(ReadStalledError) as stalled:
                ds.read_sample(0)
            assert name in str(stalled.value) and "stalled for 0.2 s" in str(stalled.value)
            with pytest.raises(ReadStalledError, match="held unavailable"):
                ds.read_sample(1)
            assert ds.metrics.counts["stalls"] == 1
            assert ds.metrics.counts["stall_ms"] >= 200
            assert ds.metrics.counts["held_fails"] == 1
            assert ds.read_sample(len(ds) - 1)["__key__"]  # other shards read fine
    finally:
        release.touch()


def _watch_table() -> Any:
    import numpy as np

    from shardio.read.watch import WATCH_SLOTS

    return np.zeros((WATCH_SLOTS + 1, 2), dtype=np.int64)


def test_watched_reads_take_no_hop_and_are_exact(
    shard: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    opener = DeadlineOpener(timeout_s=5, registry=_registry(tmp_path))
    fd = opener.open(str(shard))
    hops = opener._threads
    opener.watch(_watch_table())
    assert opener.watched
    before = {t.name for t in threading.enumerate()}
    target = bytearray(300)
    assert opener.pread_into(fd, memoryview(target), 10) == 300
    assert bytes(target) == shard.read_bytes()[10:310]
    opener.advise(fd, 0, 4096)
    # The read ran in this thread: the hop's threads did no work for it, none were added.
    assert {t.name for t in threading.enumerate()} - before == set()
    assert opener._threads is hops
    opener.close(fd)


@pytest.mark.parametrize("bad", [None, [[0, 0]], "table"])
def test_a_bad_watch_table_is_refused(bad: object) -> None:
    import numpy as np

    opener = DeadlineOpener(timeout_s=5)
    with pytest.raises(UsageError, match="watch table"):
        opener.watch(bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="watch table"):
        opener.watch(np.zeros((3, 2), dtype=np.int64))
    assert not opener.watched


def test_a_stalled_watched_read_is_held_and_counted(
    shard: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    release = tmp_path / "release"
    registry = _registry(tmp_path)
    opener = DeadlineOpener(_hang(shard, release), timeout_s=0.2, registry=registry)
    fd = opener.open(str(shard))
    table = _watch_table()
    opener.watch(table)
    reader = threading.Thread(
        target=lambda: opener.pread_into(fd, memoryview(bytearray(100)), 0), daemon=True
    )
    reader.start()
    deadline = time.monotonic() + 10
    while not table[0, 0] and time.monotonic() < deadline:
        time.sleep(0.02)
    # The monitor held the path (node-wide) and counted the stall; the read still waits
    # (only the process's replacement ends it).
    assert table[0, 0] == 1
    assert registry.held(str(shard)) is not None
    assert opener.stalls == 1
    assert reader.is_alive()
    release.touch()
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert not table[1:, 0].any()  # no call in flight any more
    with pytest.raises(ReadStalledError, match="held unavailable"):
        opener.pread_into(fd, memoryview(bytearray(10)), 0)


def test_opening_a_dataset_whose_tables_stall_is_abandoned_and_held(
    packed_small: Any, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardio.read.tables as packed

    root = packed_small("tar")[0]
    release = threading.Event()
    real = packed.load_identified

    def stalled(where: Any) -> Any:  # a manifest read waiting on a dead server
        release.wait(10)
        return real(where)

    monkeypatch.setattr(packed, "load_identified", stalled)
    opener = DeadlineOpener(timeout_s=0.1, registry=_registry(tmp_path))
    before = len(os.listdir("/proc/self/fd"))
    began = time.monotonic()
    with pytest.raises(ReadStalledError, match=f"opening the dataset {root} .*stalled for 0.1 s"):
        ShardReader(root, opener=opener)
    assert time.monotonic() - began < 5
    # The manifest is held: the next open is refused at once, not stalled again.
    with pytest.raises(ReadStalledError, match=r"not attempted.*held unavailable"):
        ShardReader(root, opener=opener)
    release.set()
    deadline = time.monotonic() + 10
    while opener.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert len(os.listdir("/proc/self/fd")) <= before  # the late index was closed
    with ShardReader(root, opener=DeadlineOpener(timeout_s=5)) as ds:  # answers: opens
        assert ds.read_sample(0)


def test_read_many_is_one_hand_off_and_exact(shard: pathlib.Path, tmp_path: pathlib.Path) -> None:
    other = tmp_path / "shard-000002.tar"
    other.write_bytes(bytes(range(255, -1, -1)) * 16)
    threads: set[int] = set()

    class Recording(PosixOpener):
        def pread_into(self, fd: int, target: memoryview, offset: int) -> int:
            threads.add(threading.get_ident())
            return super().pread_into(fd, target, offset)

    opener = DeadlineOpener(Recording(), timeout_s=5, registry=_registry(tmp_path))
    fds = [opener.open(str(shard)), opener.open(str(other))]
    spans = [(0, 0, 300), (1, 10, 100), (0, 15000, 1000), (1, 4090, 100)]  # the last: cut short
    targets = [bytearray(n) for _f, _o, n in spans]
    took: list[int] = []
    got = opener.read_many(
        [(fds[f], off, memoryview(t)) for (f, off, _n), t in zip(spans, targets, strict=True)],
        took,
    )
    assert got == [300, 100, 1000, 6]  # a read past the end says how much there was
    for (f, off, n), t, g in zip(spans, targets, got, strict=True):
        data = (shard, other)[f].read_bytes()
        assert bytes(t[:g]) == data[off : off + n]
    assert len(took) == 4 and all(ns > 0 for ns in took)
    assert len(threads) == 1 and threading.get_ident() not in threads  # one hop, not four
    for fd in fds:
        opener.close(fd)


def test_the_io_thread_lets_go_of_a_finished_read_many_targets(
    shard: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Once read_many returns, nothing of the I/O thread holds its targets: a reused batch
    buffer is free again when the batch is dropped (held by the idle thread, every other
    in-process batch on a FUSE mount was read into a fresh buffer, faulted in page by page)."""
    import gc
    import weakref

    import numpy as np

    opener = DeadlineOpener(PosixOpener(), timeout_s=5, registry=_registry(tmp_path))
    fd = opener.open(str(shard))
    owner = np.zeros(1000, dtype=np.uint8)
    gone = weakref.ref(owner)
    assert opener.read_many(
        [(fd, 0, memoryview(owner)[:500]), (fd, 500, memoryview(owner)[500:])]
    ) == [500, 500]
    assert bytes(owner) == shard.read_bytes()[:1000]
    del owner
    gc.collect()
    assert gone() is None
    opener.close(fd)


def test_a_stall_in_read_many_is_abandoned_and_the_reads_after_it_are_not_made(
    shard: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    other = tmp_path / "shard-000002.tar"
    other.write_bytes(b"y" * 4096)
    release = tmp_path / "release"
    opener = DeadlineOpener(_hang(shard, release), timeout_s=0.3, registry=_registry(tmp_path))
    fine, stuck = opener.open(str(other)), opener.open(str(shard))
    targets = [bytearray(b"\xaa" * 100) for _ in range(3)]
    began = time.monotonic()
    got = opener.read_many(
        [
            (fine, 0, memoryview(targets[0])),
            (stuck, 0, memoryview(targets[1])),
            (fine, 100, memoryview(targets[2])),
        ]
    )
    assert time.monotonic() - began < 5  # one deadline, not one per read
    assert got[0] == 100 and targets[0] == b"y" * 100
    stalled = got[1]
    # Read straight into its target, which it may still write: the caller gives that buffer up.
    assert isinstance(stalled, AbandonedBufferError) and isinstance(stalled, ReadStalledError)
    assert str(shard) in str(stalled) and "stalled for 0.3 s" in str(stalled)
    assert got[2] is None  # not attempted: its caller reads it again on its own
    assert opener.stalls == 1 and opener.abandoned == 1
    # Given up on: no longer a call of this process in flight, though its thread still waits
    # in the kernel (a file rebuilt under that path is not held back behind it).
    assert opener._calls.inflight.oldest_ns(str(shard)) == 0
    assert not opener._calls.slow(str(shard))
    release.touch()  # the stalled read completes after its caller gave up
    deadline = time.monotonic() + 10
    while opener.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert opener.abandoned == 0
    # The abandoned read wrote its target once it returned (why its buffer is given up);
    # the read after it was never made.
    assert targets[1] == shard.read_bytes()[:100]
    assert targets[2] == b"\xaa" * 100
    # Held now: its reads fail at once, the other file's are made.
    again = opener.read_many(
        [(stuck, 0, memoryview(targets[1])), (fine, 0, memoryview(targets[2]))]
    )
    assert isinstance(again[0], ReadStalledError) and "held unavailable" in str(again[0])
    assert again[1] == 100
    opener.close(fine)
    opener.close(stuck)


def test_a_batch_read_through_the_deadline_names_the_stalled_sample(
    packed_small: Any, tmp_path: pathlib.Path
) -> None:
    root = packed_small("tar")[0]
    release = tmp_path / "release"
    with ShardReader(root) as probe:
        rel = probe.manifest.shards[1].path
        bad = probe.manifest.shards[1].first_sample
        samples = [0, bad, 1]
        key = probe.key(bad)
    opener = DeadlineOpener(
        FaultyOpener([Fault(kind="hang", path=rel, release=str(release))]),
        timeout_s=0.3,
        registry=_registry(tmp_path),
    )
    from shardio.runtime.batch import read_batch

    try:
        with ShardReader(root, opener=opener) as ds, pytest.raises(StorageUnavailableError) as info:
            read_batch(ds, samples, shared=False)
        assert key in str(info.value) or rel in str(info.value)
        assert opener.stalls == 1
    finally:
        release.touch()


def test_a_reused_buffer_an_abandoned_read_may_write_is_not_reused_till_it_returns(
    packed_small: Any, tmp_path: pathlib.Path
) -> None:
    """In-process batches (reused buffers): a read abandoned into one gives it up; the batch
    is read again into a fresh buffer, and a later batch never lies in the given-up one while
    the stalled read may still write it."""
    from shardio.runtime.batch import read_batch
    from shardio.runtime.reuse import ReusedBuffers

    root = packed_small("tar")[0]
    release = tmp_path / "release"
    with ShardReader(root) as probe:
        stuck = probe.manifest.shards[1]
        fine = [probe.manifest.shards[0].first_sample]
        mixed = [*fine, stuck.first_sample]
        want = probe.read_sample(fine[0])
    opener = DeadlineOpener(
        FaultyOpener([Fault(kind="hang", path=stuck.path, release=str(release))]),
        timeout_s=0.3,
        registry=_registry(tmp_path),
    )
    buffers = ReusedBuffers(keep=3)
    given: list[int] = []

    def allocate(nbytes: int) -> Any:
        tensor = buffers.allocate(nbytes)
        given.append(tensor.data_ptr())
        return tensor

    try:
        with ShardReader(root, opener=opener) as ds:
            with pytest.raises(AbandonedBufferError):
                read_batch(ds, mixed, allocate=allocate)
            with pytest.raises(ReadStalledError, match="held unavailable"):
                into_fresh_buffers(lambda: read_batch(ds, mixed, allocate=allocate))
            batches = [into_fresh_buffers(lambda: read_batch(ds, fine, allocate=allocate))]
            batches.append(into_fresh_buffers(lambda: read_batch(ds, fine, allocate=allocate)))
            assert given[0] not in given[1:]  # the given-up buffer was handed out once
            release.touch()
            deadline = time.monotonic() + 10
            while opener.abandoned and time.monotonic() < deadline:
                time.sleep(0.01)
            assert opener.abandoned == 0
            for batch in batches:
                assert bytes(batch["jpeg"][0]) == want["jpeg"]
    finally:
        release.touch()


def test_a_slow_read_of_read_many_is_told_to_the_node_while_it_runs(
    shard: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    release = tmp_path / "release"
    registry = _registry(tmp_path)
    opener = DeadlineOpener(_hang(shard, release), timeout_s=5, registry=registry)
    fd = opener.open(str(shard))
    seen: list[bool] = []

    def watch() -> None:
        time.sleep(0.8)  # past slow_s (0.5 s): the node holds its calls on that file back
        seen.append(registry.suspected(str(shard)))
        release.touch()

    thread = threading.Thread(target=watch)
    thread.start()
    got = opener.read_many([(fd, 0, memoryview(bytearray(100)))])
    thread.join(timeout=10)
    assert got == [100] and seen == [True]
    assert not registry.suspected(str(shard))  # it returned: no longer
    assert opener.stalls == 0
    opener.close(fd)


def test_read_many_into_a_read_only_target_is_a_plain_error(shard: pathlib.Path) -> None:
    opener = DeadlineOpener(PosixOpener(), timeout_s=5)
    fd = opener.open(str(shard))
    try:
        with pytest.raises((BufferError, TypeError)):  # raised as it is, not a storage error
            opener.read_many([(fd, 0, memoryview(bytes(10)))])
    finally:
        opener.close(fd)


def _stalling_native(release: threading.Event, stuck: int) -> Any:
    """A stand-in for the compiled batch read (``read_natively``) whose read ``stuck`` waits
    for ``release``, as a read of a dead server's file waits in the kernel; it publishes
    its progress and honours a stop as ``_fastread.c`` does (tests/unit/storage/
    test_fastread.py holds the compiled call to that)."""

    def read(batch: Any, hashes: Any, progress: Any) -> Any:
        out = []
        for i, (fd, offset, target) in enumerate(batch):
            progress[0], progress[1] = i, time.monotonic_ns()
            if progress[2]:
                progress[1] = 0
                break
            if i == stuck:
                release.wait(30)
            out.append(os.preadv(fd, [target], offset))
            progress[1] = 0
        return out, [1] * len(out), None

    return read


def test_a_stall_in_a_compiled_read_many_is_abandoned_and_no_later_read_is_made(
    shard: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain POSIX opener reads a batch in one compiled call: the deadline is held over
    the read in progress it publishes; a stalled one is abandoned, the call is stopped (no
    read starts after it) and the caller gives up the batch's buffers."""
    from shardio.read import deadline as deadline_module

    release = threading.Event()
    monkeypatch.setattr(deadline_module, "read_natively", _stalling_native(release, stuck=1))
    opener = DeadlineOpener(PosixOpener(), timeout_s=0.3, registry=_registry(tmp_path))
    fd = opener.open(str(shard))
    targets = [bytearray(b"\xaa" * 100) for _ in range(3)]
    began = time.monotonic()
    try:
        got = opener.read_many([(fd, 100 * i, memoryview(t)) for i, t in enumerate(targets)])
        assert time.monotonic() - began < 5
        stalled = got[1]
        assert isinstance(stalled, AbandonedBufferError)
        assert str(shard) in str(stalled) and "at offset 100 stalled for 0.3 s" in str(stalled)
        # The call's outcomes are not waited for once it is abandoned: the caller gives up
        # every buffer of the batch (AbandonedBufferError) and reads it again.
        assert got[0] is None and got[2] is None
        assert opener.stalls == 1 and opener.abandoned == 1
        assert opener._calls.inflight.oldest_ns(str(shard)) == 0
        assert opener.registry.held(str(shard)) is not None
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while opener.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert opener.abandoned == 0
    assert targets[1] == shard.read_bytes()[100:200]  # written once it returned
    assert targets[2] == b"\xaa" * 100  # stopped: never made
    opener.close(fd)


def test_a_slow_compiled_read_is_in_flight_and_told_to_the_node_while_it_runs(
    shard: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardio.read import deadline as deadline_module

    release = threading.Event()
    monkeypatch.setattr(deadline_module, "read_natively", _stalling_native(release, stuck=0))
    registry = _registry(tmp_path)
    opener = DeadlineOpener(PosixOpener(), timeout_s=5, registry=registry)
    fd = opener.open(str(shard))
    seen: list[bool] = []

    def watch() -> None:
        time.sleep(0.8)  # past slow_s (0.5 s)
        seen.extend([registry.suspected(str(shard)), opener._calls.slow(str(shard))])
        release.set()

    thread = threading.Thread(target=watch)
    thread.start()
    got = opener.read_many([(fd, 0, memoryview(bytearray(100)))])
    thread.join(timeout=10)
    assert got == [100] and seen == [True, True]
    assert not registry.suspected(str(shard)) and not opener._calls.slow(str(shard))
    assert opener.stalls == 0
    opener.close(fd)


def test_a_compiled_read_many_checks_each_member(
    shard: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Through the deadline, a plain POSIX opener's batch is hashed in the compiled call:
    every member filled is judged with its xxh3-64, a short one is not."""
    import xxhash

    from shardio.storage.opener import MemberHashes, reads_natively

    opener = DeadlineOpener(PosixOpener(), timeout_s=5, registry=_registry(tmp_path))
    fd = opener.open(str(shard))
    data = shard.read_bytes()
    targets = [memoryview(bytearray(n)) for n in (300, 1000, 100)]
    offsets = [0, 5000, len(data) - 40]
    judged: dict[int, int] = {}
    hashes = MemberHashes(targets, judged.__setitem__)
    assert reads_natively(opener.inner, hashes)
    got = opener.read_many(
        [(fd, off, t) for off, t in zip(offsets, targets, strict=True)], None, hashes
    )
    opener.close(fd)
    assert got == [300, 1000, 40]
    assert judged == {
        0: xxhash.xxh3_64_intdigest(data[:300]),
        1: xxhash.xxh3_64_intdigest(data[5000:6000]),
    }


# -- several runs at once --------------------------------------------------------------------
def test_runs_at_once_each_take_one_hand_off_and_are_exact(
    shard: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """``parallel`` 3: the reads in three runs of neighbours, each one hand-off to an I/O
    thread of its own (the caller only watches); outcomes and times by the batch's index."""
    threads: dict[int, set[int]] = {}

    class Recording(PosixOpener):
        def pread_into(self, fd: int, target: memoryview, offset: int) -> int:
            threads.setdefault(offset, set()).add(threading.get_ident())
            time.sleep(0.1)  # a network round trip: the runs overlap
            return super().pread_into(fd, target, offset)

    opener = DeadlineOpener(Recording(), timeout_s=5, registry=_registry(tmp_path))
    fd = opener.open(str(shard))
    data = shard.read_bytes()
    offsets = [0, 700, 1400, 2100, 2800, len(data) - 30]  # the last: cut short
    targets = [bytearray(100) for _ in offsets]
    took: list[int] = []
    got = opener.read_many(
        [(fd, off, memoryview(t)) for off, t in zip(offsets, targets, strict=True)],
        took,
        parallel=3,
    )
    opener.close(fd)
    assert got == [100, 100, 100, 100, 100, 30]
    for off, t, n in zip(offsets, targets, got, strict=True):
        assert bytes(t[:n]) == data[off : off + n]
    assert len(took) == 6 and all(ns > 0 for ns in took)
    by_run = [threads[0] | threads[700], threads[1400] | threads[2100], threads[2800]]
    assert all(len(ids) == 1 for ids in by_run)  # a run is read in turn on one thread
    assert len(set().union(*by_run)) == 3 and threading.get_ident() not in set().union(*by_run)


def test_a_compiled_read_in_runs_checks_each_member(
    shard: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    import xxhash

    from shardio.storage.opener import MemberHashes

    opener = DeadlineOpener(PosixOpener(), timeout_s=5, registry=_registry(tmp_path))
    fd = opener.open(str(shard))
    data = shard.read_bytes()
    offsets = list(range(0, 8000, 1000))
    targets = [memoryview(bytearray(300)) for _ in offsets]
    judged: dict[int, int] = {}
    got = opener.read_many(
        [(fd, off, t) for off, t in zip(offsets, targets, strict=True)],
        None,
        MemberHashes(targets, judged.__setitem__),
        parallel=4,
    )
    opener.close(fd)
    assert got == [300] * len(offsets)
    assert judged == {j: xxhash.xxh3_64_intdigest(data[o : o + 300]) for j, o in enumerate(offsets)}


def test_a_stall_in_one_run_leaves_the_other_runs_whole(
    shard: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """One run stalls on a dead file: it alone is abandoned (one deadline), its later reads
    not made; the runs beside it return every byte."""
    other = tmp_path / "shard-000002.tar"
    other.write_bytes(b"y" * 4096)
    release = tmp_path / "release"
    opener = DeadlineOpener(_hang(shard, release), timeout_s=0.3, registry=_registry(tmp_path))
    fine, stuck = opener.open(str(other)), opener.open(str(shard))
    fds = [fine, fine, stuck, fine, fine, fine]  # runs: [0, 1], [2, 3], [4, 5]
    targets = [bytearray(b"\xaa" * 100) for _ in fds]
    began = time.monotonic()
    try:
        got = opener.read_many(
            [
                (fd, 100 * i, memoryview(t))
                for i, (fd, t) in enumerate(zip(fds, targets, strict=True))
            ],
            parallel=3,
        )
        assert time.monotonic() - began < 5
        assert got[:2] == [100, 100] and got[4:] == [100, 100]
        assert all(targets[i] == b"y" * 100 for i in (0, 1, 4, 5))
        assert isinstance(got[2], AbandonedBufferError) and str(shard) in str(got[2])
        assert got[3] is None  # after the stalled read in its run: not made
        assert opener.stalls == 1 and opener.abandoned == 1
        assert opener._calls.inflight.oldest_ns(str(shard)) == 0
        assert not opener.registry.suspected(str(shard))  # held now, no longer suspected
    finally:
        release.touch()
    deadline = time.monotonic() + 10
    while opener.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert opener.abandoned == 0 and targets[3] == b"\xaa" * 100
    opener.close(fine)
    opener.close(stuck)


def test_a_stalled_compiled_run_is_stopped_and_the_others_return(
    shard: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardio.read import deadline as deadline_module

    release = threading.Event()
    stalling = _stalling_native(release, stuck=0)
    real = deadline_module.read_natively

    def read(batch: Any, hashes: Any, progress: Any) -> Any:
        # The second run (offsets 200 and 300) stalls on its first read; the others read.
        return (
            stalling(batch, hashes, progress)
            if batch[0][1] == 200
            else real(batch, hashes, progress)
        )

    monkeypatch.setattr(deadline_module, "read_natively", read)
    opener = DeadlineOpener(PosixOpener(), timeout_s=0.3, registry=_registry(tmp_path))
    fd = opener.open(str(shard))
    data = shard.read_bytes()
    targets = [bytearray(b"\xaa" * 100) for _ in range(6)]
    try:
        got = opener.read_many(
            [(fd, 100 * i, memoryview(t)) for i, t in enumerate(targets)], parallel=3
        )
        assert got[:2] == [100, 100] and got[4:] == [100, 100]
        assert isinstance(got[2], AbandonedBufferError) and got[3] is None
        assert opener.stalls == 1
        for i in (0, 1, 4, 5):
            assert bytes(targets[i]) == data[100 * i : 100 * i + 100]
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while opener.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert opener.abandoned == 0 and targets[3] == b"\xaa" * 100  # stopped: never made
    opener.close(fd)


def test_runs_past_the_cap_of_abandoned_calls_fail_at_once(
    shard: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    release = tmp_path / "release"
    opener = DeadlineOpener(
        _hang(shard, release), timeout_s=0.2, registry=_registry(tmp_path), max_abandoned=1
    )
    other = tmp_path / "shard-000003.tar"
    other.write_bytes(b"z" * 1000)
    fd, ok = opener.open(str(shard)), opener.open(str(other))
    try:
        first = opener.read_many([(fd, 0, memoryview(bytearray(10)))])
        assert isinstance(first[0], AbandonedBufferError)
        began = time.monotonic()
        got = opener.read_many(
            [(ok, 100 * i, memoryview(bytearray(10))) for i in range(4)], parallel=2
        )
        assert time.monotonic() - began < 2
        assert all(isinstance(g, ReadStalledError) and "not attempted" in str(g) for g in got)
    finally:
        release.touch()


def test_an_error_while_watching_waits_for_the_runs_before_it_raises(
    shard: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever interrupts the watcher (here the node registry failing; a KeyboardInterrupt
    alike) is raised only once no run can write the caller's buffers any more."""
    registry = _registry(tmp_path)
    finished: list[bytes] = []

    class Slow(PosixOpener):
        def pread_into(self, fd: int, target: memoryview, offset: int) -> int:
            time.sleep(0.8)  # past slow_s (0.5 s): the watcher tells the node
            got = super().pread_into(fd, target, offset)
            finished.append(bytes(target))
            return got

    def boom(path: str, seconds: float) -> None:
        raise RuntimeError("registry gone")

    monkeypatch.setattr(registry, "suspect", boom)
    opener = DeadlineOpener(Slow(), timeout_s=5, registry=registry)
    fd = opener.open(str(shard))
    targets = [bytearray(100) for _ in range(2)]
    with pytest.raises(RuntimeError, match="registry gone"):
        opener.read_many([(fd, 100 * i, memoryview(t)) for i, t in enumerate(targets)], parallel=2)
    assert len(finished) == 2  # both runs had returned when it raised
    opener.close(fd)


def test_two_runs_slow_on_one_file_tell_the_node_once(
    shard: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    registry = _registry(tmp_path)
    told: list[str] = []
    ended: list[str] = []
    suspect, unsuspect = registry.suspect, registry.unsuspect

    def counting_suspect(path: str, seconds: float) -> None:
        told.append(path)
        suspect(path, seconds)

    def counting_unsuspect(path: str) -> None:
        ended.append(path)
        unsuspect(path)

    registry.suspect, registry.unsuspect = counting_suspect, counting_unsuspect  # type: ignore[method-assign]

    class Slow(PosixOpener):
        def pread_into(self, fd: int, target: memoryview, offset: int) -> int:
            time.sleep(0.8)  # past slow_s (0.5 s), in both runs at once
            return super().pread_into(fd, target, offset)

    opener = DeadlineOpener(Slow(), timeout_s=5, registry=registry)
    fd = opener.open(str(shard))
    got = opener.read_many(
        [(fd, 0, memoryview(bytearray(10))), (fd, 10, memoryview(bytearray(10)))], parallel=2
    )
    opener.close(fd)
    assert got == [10, 10]
    assert told == [str(shard)] and ended == [str(shard)]
    assert not registry.suspected(str(shard))
