"""A dead data server costs about one read deadline per dead shard, whatever the client's
retries: nothing waits for the client (not a close of a dead file, not the join of a worker
stuck in the kernel, not a substitute's reopen), and nothing stuck blocks the exit.

A FUSE client (MooseFS, measured on the bed with its default 30 retries) answers the close
of a file (a flush) only once a pending read of it ends, about 2 minutes later, and a worker
killed during such a read stays in the kernel as long: the opener here hangs such closes,
and fake worker handles stand in for a process that SIGKILL cannot end at once.
"""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from shardio import ShardDataset, ShardLoader
from shardio.errors import ReadStalledError
from shardio.read.deadline import DeadlineOpener
from shardio.read.faults import Fault, FaultyOpener
from shardio.read.reader import ShardReader
from shardio.read.unavailable import UnavailableShards
from shardio.runtime.reaping import KILLED_GRACE_S, STOP_GRACE_S, kill_workers, stop_workers
from shardio.storage.opener import PosixOpener

_T = 0.5  # read_timeout_s of the epochs here


@dataclass
class _FuseLikeOpener(FaultyOpener):
    """Reads of a dead file hang (its server is down) and so does a close of it (the client
    answers a flush only once the pending read ends); each such close leaves a marker."""

    dead: tuple[str, ...] = ()
    release: str = ""
    marks: str = ""

    def __post_init__(self) -> None:
        self.faults = [Fault(kind="hang", path=d, release=self.release) for d in self.dead]
        super().__post_init__()

    def __getstate__(self) -> dict[str, object]:
        return {"dead": self.dead, "release": self.release, "marks": self.marks}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.dead = state["dead"]  # type: ignore[assignment]
        self.release = str(state["release"])
        self.marks = str(state["marks"])
        self.__post_init__()

    def close(self, fd: int) -> None:
        path = self._paths.get(fd, "")
        if any(d in path for d in self.dead):
            pathlib.Path(self.marks, f"closed-{os.getpid()}-{fd}").touch()
            end = time.monotonic() + 60
            while not os.path.exists(self.release) and time.monotonic() < end:
                time.sleep(0.02)
        super().close(fd)


@pytest.fixture
def dataset(packed_small: Any, tmp_path: pathlib.Path) -> pathlib.Path:
    # A copy per test: the node's registry of held shards is keyed by the dataset's path.
    dst = tmp_path / "ds"
    shutil.copytree(packed_small("tar", "1MiB")[0], dst)
    return dst


@pytest.fixture
def release(tmp_path: pathlib.Path) -> Any:
    path = tmp_path / "release"
    yield path
    path.touch()  # every hung read and close ends with the test


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_over_a_dead_server_costs_about_a_deadline_per_dead_shard(
    dataset: pathlib.Path, release: pathlib.Path, tmp_path: pathlib.Path, workers: int
) -> None:
    with ShardReader(dataset) as ds:
        shard_names = [s.path for s in ds.manifest.shards]
        truth = {ds.key(i): ds.read_sample(i) for i in range(len(ds))}
        shard_of = {ds.key(i): ds.manifest.shards[ds.shard_of(i)].path for i in range(len(ds))}
    dead = tuple(shard_names[1::2])  # half the shards
    assert len(dead) >= 2
    lost = {k for k, s in shard_of.items() if s in dead}
    marks = tmp_path / "marks"
    marks.mkdir()
    opener = _FuseLikeOpener(dead=dead, release=str(release), marks=str(marks))
    ds = ShardDataset(dataset, seed=3, read_timeout_s=_T, opener=opener, recovery="skip")
    loader = ShardLoader(ds, batch_size=16, num_workers=workers)
    began = time.monotonic()
    delivered: list[str] = []
    for batch in loader:
        keys = list(batch["__key__"])
        for name, column in batch.items():
            if name in ("__key__", "cls"):
                continue
            for key, value in zip(keys, column, strict=True):
                assert bytes(value) == truth[key][name], (key, name)  # verified bytes only
        delivered += keys
    loader.close()
    took = time.monotonic() - began
    counters = loader.metrics().counters
    # One deadline per dead shard and reading process, not one per sample (150 samples
    # here) nor a wait for the client; generous for a loaded machine.
    assert took < 3 * _T * len(dead) * max(1, workers) + 10, (took, counters)
    assert len(delivered) == len(truth)
    assert not lost & set(delivered)
    # Every repeat is a counted substitute.
    repeats = len(delivered) - len(set(delivered))
    assert counters["substitutes"] == len(lost)
    assert repeats <= counters["substitutes"]
    assert 1 <= counters["stalls"] <= len(dead) * max(1, workers)  # per shard, not sample
    # No close of a dead file was even attempted: it would hold a client thread for minutes.
    assert list(marks.iterdir()) == []


class _Unending:
    """A worker process handle that SIGKILL does not end (it waits in the kernel)."""

    def __init__(self, ended: threading.Event) -> None:
        self.pid = None  # nothing to signal
        self.ended = ended
        self.joins: list[float | None] = []
        self.killed = False

    def is_alive(self) -> bool:
        return not self.ended.is_set()

    def join(self, timeout: float | None = None) -> None:
        self.joins.append(timeout)
        self.ended.wait(timeout)

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        self.killed = True


class _Iterator:
    """The parts of a DataLoader iterator its shutdown uses, as torch's shuts down."""

    def __init__(self, workers: list[Any]) -> None:
        self._workers = workers
        self._worker_pids_set = False
        self.shut = False

    def _shutdown_workers(self) -> None:
        for w in self._workers:
            w.join(timeout=5.0)  # torch's MP_STATUS_CHECK_INTERVAL
        for w in self._workers:
            if w.is_alive():
                w.terminate()
                w.join(timeout=5.0)
        self.shut = True


def test_killing_workers_stuck_in_the_kernel_costs_the_grace_not_seconds_each() -> None:
    ended = threading.Event()
    workers = [_Unending(ended), _Unending(ended)]
    batches = _Iterator(list(workers))
    try:
        began = time.monotonic()
        kill_workers(batches)
        stop_workers(batches)  # what the loader does next
        took = time.monotonic() - began
        assert batches.shut
        assert took < KILLED_GRACE_S + 1.5, took  # was 5 s per worker, twice
        assert all(w.killed for w in workers)  # killed again and left to a reaper thread
        assert any(t.name == "shardio-reaper" for t in threading.enumerate())
        assert not any(w.is_alive() for w in batches._workers)  # torch sees them gone
    finally:
        ended.set()


def test_stopping_workers_politely_is_bounded_too() -> None:
    ended = threading.Event()
    batches = _Iterator([_Unending(ended), _Unending(ended), _Unending(ended)])
    try:
        began = time.monotonic()
        stop_workers(batches)
        took = time.monotonic() - began
        assert batches.shut
        assert took < STOP_GRACE_S + 1.5, took  # was 10 s per worker
    finally:
        ended.set()


def _sleep_forever() -> None:
    time.sleep(3600)


def test_an_abandoned_worker_is_no_child_the_exit_waits_for() -> None:
    from shardio.runtime.reaping import bound_workers

    process = multiprocessing.get_context("fork").Process(target=_sleep_forever, daemon=True)
    process.start()
    batches = _Iterator([process])
    bound_workers(batches, 0.0)
    batches._workers[0].join()
    # multiprocessing's exit handler joins every process in active_children(), unbounded.
    assert process not in multiprocessing.active_children()
    end = time.monotonic() + 10  # the SIGKILL of the abandon ends it; the reaper reaps it
    while process.exitcode is None and time.monotonic() < end:
        time.sleep(0.02)
    assert process.exitcode is not None


class _CountingOpener(PosixOpener):
    def __init__(self) -> None:
        self.closed: list[int] = []

    def close(self, fd: int) -> None:
        self.closed.append(fd)
        super().close(fd)


def test_a_held_file_is_not_closed(tmp_path: pathlib.Path) -> None:
    (tmp_path / "shm").mkdir()
    registry = UnavailableShards("ds", hold_s=60, root=str(tmp_path / "shm"))
    inner = _CountingOpener()
    opener = DeadlineOpener(inner, timeout_s=5, registry=registry)
    dead, alive = tmp_path / "shard-000001.tar", tmp_path / "shard-000002.tar"
    dead.write_bytes(b"x" * 100)
    alive.write_bytes(b"y" * 100)
    fd_dead, fd_alive = opener.open(str(dead)), opener.open(str(alive))
    registry.mark(str(dead))
    opener.close(fd_dead)  # its read may still pend: the flush would wait with it
    opener.close(fd_alive)
    assert inner.closed == [fd_alive]
    os.fstat(fd_dead)  # still open, kept
    opener.release(str(dead))  # its file rebuilt: closed as any other
    opener.close(fd_dead)
    assert inner.closed == [fd_alive, fd_dead]


@dataclass
class _AdvisedHang(FaultyOpener):
    """Reads of the files the faults name hang; advice and closes are recorded."""

    advised: list[int] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)

    def advise(self, fd: int, offset: int, length: int) -> None:
        self.advised.append(offset)

    def close(self, fd: int) -> None:
        self.closed.append(fd)
        super().close(fd)


def test_a_slow_file_gets_one_request_no_advice_and_no_close(
    tmp_path: pathlib.Path, release: pathlib.Path
) -> None:
    (tmp_path / "shm").mkdir()
    registry = UnavailableShards("ds", hold_s=60, root=str(tmp_path / "shm"))
    path = tmp_path / "shard-000001.tar"
    path.write_bytes(b"z" * 8192)
    inner = _AdvisedHang([Fault(kind="hang", path=path.name, release=str(release))])
    opener = DeadlineOpener(inner, timeout_s=1.0, registry=registry)
    fd = opener.open(str(path))
    errors: list[BaseException] = []

    def first() -> None:
        try:
            opener.pread_into(fd, memoryview(bytearray(100)), 0)
        except ReadStalledError as exc:
            errors.append(exc)

    reader = threading.Thread(target=first, daemon=True)
    reader.start()
    time.sleep(0.4)  # past slow_s (0.1 s): the file does not answer promptly
    opener.advise(fd, 4096, 4096)  # would queue behind the pending read
    began = time.monotonic()
    with pytest.raises(ReadStalledError, match="held unavailable"):
        opener.pread_into(fd, memoryview(bytearray(100)), 4096)  # waits, sends nothing
    assert time.monotonic() - began < 2.0
    reader.join(timeout=5)
    assert len(errors) == 1 and "stalled for 1 s" in str(errors[0])
    assert inner.fired == [1]  # one request reached the file: the first read
    assert inner.advised == []
    opener.close(fd)  # its flush would wait with the pending read
    assert inner.closed == []


def test_workers_on_a_fuse_mount_read_through_the_deadline_threads() -> None:
    from shardio.read.timeouts import replaceable_readers
    from shardio.storage.fsdetect import FsInfo

    # Killing a worker closes its files; on FUSE each close of a dead file waits minutes.
    assert not replaceable_readers(FsInfo(name="moosefs", magic=0x65735546, mount_type="fuse.mfs"))
    assert not replaceable_readers(FsInfo(name="unknown", magic=0, mount_type="fuse.sshfs"))
    assert replaceable_readers(FsInfo(name="lustre", magic=0x0BD00BD0, mount_type="lustre"))
    assert replaceable_readers(FsInfo(name="ext4", magic=0xEF53, mount_type="ext4"))
    assert replaceable_readers(None)


def test_a_fresh_hold_survives_a_refresh_that_lists_the_directory_before_it(
    tmp_path: pathlib.Path,
) -> None:
    # Seen on the bed: four reads of one worker stalled together; a thread's refresh listed
    # the directory between another's mark and the write of its entry, and dropped the
    # hold: the next read of that dead file went out and held a client thread for minutes.
    now = [100.0]
    (tmp_path / "shm").mkdir()
    registry = UnavailableShards("ds", hold_s=60, root=str(tmp_path / "shm"), clock=lambda: now[0])
    registry.mark("/pfs/ds/shards/shard-000001.tar")
    (entry,) = [p for p in (tmp_path / "shm").rglob("*") if p.is_file()]
    entry.unlink()  # as if not written yet when another thread lists the directory
    now[0] += 0.3
    registry.mark("/pfs/ds/shards/shard-000002.tar")  # the directory changes
    now[0] += 0.3
    assert registry.held("/pfs/ds/shards/shard-000001.tar") is not None
    assert registry.held("/pfs/ds/shards/shard-000002.tar") is not None
    now[0] += 5.0  # long after: the node's directory is the truth again
    registry.mark("/pfs/ds/shards/shard-000003.tar")
    now[0] += 1.0
    assert registry.held("/pfs/ds/shards/shard-000001.tar") is None


def test_kept_descriptors_of_held_files_are_bounded(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardio.read.deadline as deadline

    monkeypatch.setattr(deadline, "MAX_KEPT", 2)
    (tmp_path / "shm").mkdir()
    registry = UnavailableShards("ds", hold_s=60, root=str(tmp_path / "shm"))
    inner = _CountingOpener()
    opener = DeadlineOpener(inner, timeout_s=5, registry=registry)
    fds = []
    for i in range(3):
        path = tmp_path / f"shard-{i:06d}.tar"
        path.write_bytes(b"x")
        fds.append(opener.open(str(path)))
        registry.mark(str(path))
    for fd in fds:
        opener.close(fd)
    assert inner.closed == [fds[2]]  # a dead server with thousands of shards: no fd leak


def test_a_slow_file_is_held_back_on_the_whole_node(
    tmp_path: pathlib.Path, release: pathlib.Path
) -> None:
    # Two workers touching a dead file within one deadline sent two requests, each holding
    # a client thread for minutes: the second process now waits for the first one's call.
    (tmp_path / "shm").mkdir()
    path = tmp_path / "shard-000001.tar"
    path.write_bytes(b"z" * 8192)
    openers, registries = [], []
    for _ in range(2):  # two processes of the node: their own registry objects
        registry = UnavailableShards("ds", hold_s=60, root=str(tmp_path / "shm"))
        inner = FaultyOpener([Fault(kind="hang", path=path.name, release=str(release))])
        openers.append(DeadlineOpener(inner, timeout_s=1.0, registry=registry))
        registries.append(registry)
    first, second = openers
    fd_first, fd_second = first.open(str(path)), second.open(str(path))
    errors: list[BaseException] = []

    def read_first() -> None:
        try:
            first.pread_into(fd_first, memoryview(bytearray(10)), 0)
        except ReadStalledError as exc:
            errors.append(exc)

    reader = threading.Thread(target=read_first, daemon=True)
    reader.start()

    # Past slow_s (0.1 s) the first process tells the node; on a loaded machine that may
    # take longer than any fixed sleep, so wait until the second one's registry sees it.
    # (Past the first read's 1 s deadline the file is held instead: the same answer.)
    def told() -> bool:
        return registries[1].suspected(str(path)) or registries[1].held(str(path)) is not None

    end = time.monotonic() + 10
    while not told() and time.monotonic() < end:
        time.sleep(0.02)
    assert told(), "the first process never told the node"
    with pytest.raises(ReadStalledError, match="held unavailable"):
        second.pread_into(fd_second, memoryview(bytearray(10)), 0)
    reader.join(timeout=5)
    assert len(errors) == 1  # the first one's read stalled; it held the file
    assert first.inner.fired == [1]  # type: ignore[attr-defined]
    assert second.inner.fired == [0]  # type: ignore[attr-defined]  # no request at all
