"""The compiled batch read (shardio.storage._fastread) against the pure-Python path it
replaces for a plain POSIX opener: the same bytes, outcomes, digests and errors.

Every test that reads through ``read_each`` runs both ways (the ``path`` fixture): with the
module, and with it switched off as in a build without a C compiler.
"""

from __future__ import annotations

import errno
import os
import pathlib
import shutil
import threading
import time

import numpy as np
import pytest
import xxhash

from shardio import ShardDataset
from shardio.errors import ChecksumMismatchError, StorageError
from shardio.read.reader import ShardReader
from shardio.storage import opener as opener_module
from shardio.storage.opener import MemberHashes, PosixOpener, read_each, read_many, split_runs

SIZES = [0, 1, 15, 16, 17, 128, 129, 240, 241, 1024, 4096, 110_000, (1 << 20) + 7]


def test_the_compiled_module_is_built() -> None:
    """`make install` builds it (CI has a C compiler); a build without it reads the same
    bytes the pure-Python way, but this install must have it."""
    from shardio.storage import _fastread

    assert opener_module._fastread is _fastread


@pytest.fixture(params=["compiled", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        monkeypatch.setattr(opener_module, "_fastread", None)
    return str(request.param)


@pytest.fixture
def blob(tmp_path: pathlib.Path) -> tuple[pathlib.Path, bytes]:
    data = os.urandom(sum(SIZES) + 4096)
    file = tmp_path / "blob"
    file.write_bytes(data)
    return file, data


def test_digests_are_xxhash_s(path: str) -> None:
    from shardio.storage import _fastread

    for size in SIZES:
        data = os.urandom(size)
        assert _fastread.xxh3_64(data) == xxhash.xxh3_64_intdigest(data), size


@pytest.mark.parametrize("parallel", [1, 4])
def test_reads_outcomes_and_digests_match(
    path: str, blob: tuple[pathlib.Path, bytes], parallel: int
) -> None:
    """``parallel`` 4: the same reads in four runs at once (the first in this thread, the
    others on plain I/O threads); outcomes, times and judged digests by the batch's index."""
    file, data = blob
    fd = os.open(file, os.O_RDONLY)
    try:
        reads, at = [], 0
        for size in SIZES:
            reads.append((fd, at, memoryview(bytearray(size))))
            at += size
        # One past the end (short), one wholly past it (0 bytes), one on a bad descriptor.
        reads.append((fd, len(data) - 10, memoryview(bytearray(100))))
        reads.append((fd, len(data) + 5, memoryview(bytearray(8))))
        bad = os.open(file, os.O_RDONLY)
        os.close(bad)
        reads.append((bad, 0, memoryview(bytearray(8))))
        judged: dict[int, int] = {}
        took: list[int] = []
        got = read_each(
            PosixOpener(),
            reads,
            took,
            MemberHashes([t for _fd, _off, t in reads], judged.__setitem__),
            parallel=parallel,
        )
    finally:
        os.close(fd)
    n = len(SIZES)
    assert got[:n] == SIZES
    assert got[n : n + 2] == [10, 0]
    error = got[n + 2]
    assert isinstance(error, OSError) and error.errno == errno.EBADF
    at = 0
    for i, size in enumerate(SIZES):
        assert bytes(reads[i][2]) == data[at : at + size]
        assert judged[i] == xxhash.xxh3_64_intdigest(data[at : at + size])
        at += size
    assert bytes(reads[n][2][:10]) == data[-10:]
    assert n + 2 not in judged  # an error is never judged
    assert len(took) == len(reads) and all(t >= 0 for t in took)


def test_without_a_check_nothing_is_judged(path: str, blob: tuple[pathlib.Path, bytes]) -> None:
    file, data = blob
    fd = os.open(file, os.O_RDONLY)
    try:
        target = memoryview(bytearray(1000))
        assert read_many(PosixOpener(), [(fd, 3, target)]) == [1000]
    finally:
        os.close(fd)
    assert bytes(target) == data[3:1003]


def test_runs_split_the_reads_evenly_in_order() -> None:
    assert split_runs(0, 4) == []
    assert split_runs(3, 1) == [range(3)]
    assert split_runs(3, 8) == [range(1), range(1, 2), range(2, 3)]
    assert split_runs(10, 4) == [range(2), range(2, 5), range(5, 7), range(7, 10)]
    assert split_runs(5, 0) == [range(5)]


def test_runs_at_once_use_named_daemon_threads_and_a_fork_gets_its_own() -> None:
    """Reads with no deadline in several runs: the runs but the first on ``shardio-io``
    threads; a forked child (a DataLoader worker) starts threads of its own."""
    import subprocess
    import sys

    code = (
        "import os, sys, threading\n"
        "from shardio.storage.opener import PosixOpener, read_each\n"
        "from shardio.storage.stall import plain_threads\n"
        "fd = os.open(sys.executable, os.O_RDONLY)\n"
        "def read():\n"
        "    ts = [memoryview(bytearray(64)) for _ in range(4)]\n"
        "    reads = [(fd, 64 * i, t) for i, t in enumerate(ts)]\n"
        "    got = read_each(PosixOpener(), reads, parallel=4)\n"
        "    return got == [64] * 4\n"
        "assert read()\n"
        "parent = plain_threads()\n"
        "names = [t for t in threading.enumerate() if t.name == 'shardio-io']\n"
        "assert names and all(t.daemon for t in names), names\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if read() and plain_threads() is not parent else 1)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=60, check=False)
    assert done.returncode == 0


def test_a_read_only_target_raises_before_any_read(
    path: str, blob: tuple[pathlib.Path, bytes]
) -> None:
    file, _data = blob
    fd = os.open(file, os.O_RDONLY)
    first = memoryview(bytearray(10))
    try:
        with pytest.raises((BufferError, TypeError)):
            read_each(PosixOpener(), [(fd, 0, first), (fd, 0, memoryview(bytes(10)))])
    finally:
        os.close(fd)
    if path == "compiled":
        assert bytes(first) == bytes(10)  # nothing read: the targets are taken first


def test_a_wrapped_opener_reads_the_python_way(
    blob: tuple[pathlib.Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a plain PosixOpener goes to C: a subclass (a fault injector, a caller's) is
    called read by read, as it expects."""

    class Counting(PosixOpener):
        calls = 0

        def pread_into(self, fd: int, target: memoryview, offset: int) -> int:
            Counting.calls += 1
            return super().pread_into(fd, target, offset)

    file, data = blob
    fd = os.open(file, os.O_RDONLY)
    try:
        targets = [memoryview(bytearray(100)) for _ in range(3)]
        got = read_each(Counting(), [(fd, 100 * i, t) for i, t in enumerate(targets)])
    finally:
        os.close(fd)
    assert got == [100, 100, 100] and Counting.calls == 3
    assert b"".join(bytes(t) for t in targets) == data[:300]


@pytest.fixture
def dataset(packed_small, tmp_path: pathlib.Path) -> pathlib.Path:  # type: ignore[no-untyped-def]
    src, _result = packed_small()
    dst = tmp_path / "ds"
    shutil.copytree(src, dst)
    return dst


def _payload_member(ds: ShardReader, sample: int) -> tuple[str, int]:
    for m in ds.index.sample_member_range(sample):
        rec = ds.index.members[m]
        if int(rec["size"]) > 0:
            return ds.shard_path(ds.shard_of(sample)), int(rec["offset"])
    raise AssertionError("no payload member")


@pytest.mark.parametrize("mode", ["map", "stream"])
def test_a_dataset_reads_the_same_both_ways(
    dataset: pathlib.Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def epoch() -> list[tuple[str, bytes]]:
        ds = ShardDataset(dataset, mode=mode, shuffle=True, seed=3)
        out = []
        for batch in ds.loader(batch_size=16):
            col = batch["jpeg"]
            out += [(k, bytes(col[i])) for i, k in enumerate(batch["__key__"])]
        return out

    compiled = epoch()
    monkeypatch.setattr(opener_module, "_fastread", None)
    assert epoch() == compiled
    assert len(compiled) == ShardDataset(dataset).num_samples


def test_a_flipped_byte_on_disk_is_caught(path: str, dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as plain:
        sample = plain.manifest.shards[0].first_sample + 2
        file, offset = _payload_member(plain, sample)
        key = plain.key(sample)
    with open(file, "r+b") as fh:
        fh.seek(offset + 5)
        byte = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([byte[0] ^ 0x10]))
    ds = ShardDataset(dataset, mode="map")
    with pytest.raises(ChecksumMismatchError) as info:
        for _batch in ds.loader(batch_size=8):
            pass
    assert info.value.key == key


def test_a_truncated_shard_on_disk_is_a_storage_error(path: str, dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as plain:
        file, offset = _payload_member(plain, plain.manifest.shards[0].first_sample + 2)
    os.truncate(file, offset + 7)
    ds = ShardDataset(dataset, mode="map")
    with pytest.raises(StorageError, match=r"truncat|short|size"):
        for _batch in ds.loader(batch_size=8):
            pass


# -------------------------------------------------------------- progress and stop (deadlines)


def test_progress_names_each_read_and_is_idle_after(blob: tuple[pathlib.Path, bytes]) -> None:
    from shardio.storage import _fastread

    file, data = blob
    fd = os.open(file, os.O_RDONLY)
    progress = np.zeros(3, dtype=np.int64)
    try:
        targets = [memoryview(bytearray(100)) for _ in range(4)]
        got, digests, took = _fastread.pread_many(
            [(fd, 100 * i, t) for i, t in enumerate(targets)], True, progress
        )
    finally:
        os.close(fd)
    assert got == [100] * 4 and len(digests or []) == 4 and len(took) == 4
    assert progress.tolist() == [3, 0, 0]  # the last read's index; none in progress
    assert b"".join(bytes(t) for t in targets) == data[:400]


def test_a_stopped_call_makes_no_read_and_writes_no_target(
    blob: tuple[pathlib.Path, bytes],
) -> None:
    from shardio.storage import _fastread

    file, _data = blob
    fd = os.open(file, os.O_RDONLY)
    progress = np.zeros(3, dtype=np.int64)
    assert _fastread.stop_reads(progress) == (0, 0)  # none in progress, none will start
    target = memoryview(bytearray(b"\xaa" * 100))
    try:
        assert _fastread.pread_many([(fd, 0, target)], True, progress) == ([], [], [])
    finally:
        os.close(fd)
    assert bytes(target) == b"\xaa" * 100


def test_a_stop_from_another_thread_ends_the_call_between_reads(tmp_path: pathlib.Path) -> None:
    """A long batch stopped while it runs: the reads made are a prefix, each exact; no read
    after them wrote its target; the read stop_reads reported was the last one made."""
    from shardio.storage import _fastread

    file = tmp_path / "data"
    data = os.urandom(1 << 16)
    file.write_bytes(data)
    n = 200_000
    targets = [memoryview(bytearray(b"\xaa")) for _ in range(n)]
    progress = np.zeros(3, dtype=np.int64)
    fd = os.open(file, os.O_RDONLY)
    out: dict[str, object] = {}

    def run() -> None:
        out["got"] = _fastread.pread_many(
            [(fd, i % len(data), t) for i, t in enumerate(targets)], False, progress
        )

    thread = threading.Thread(target=run)
    try:
        thread.start()
        while int(progress[0]) < 1000 and thread.is_alive():  # under way
            time.sleep(0.001)
        index, began = _fastread.stop_reads(progress)
        thread.join(timeout=30)
    finally:
        os.close(fd)
    got, digests, _took = out["got"]  # type: ignore[misc]
    made = len(got)
    assert 1000 <= made < n, made  # stopped, not run to the end
    assert digests is None and got == [1] * made
    assert index in (made - 1, made) and (began == 0 or index == made - 1)
    assert all(bytes(targets[i]) == data[i % len(data) : i % len(data) + 1] for i in range(made))
    assert all(bytes(t) == b"\xaa" for t in targets[made:])


@pytest.mark.parametrize("bad", [np.zeros(2, dtype=np.int64), bytes(24), None])
def test_a_bad_progress_buffer_is_refused(bad: object) -> None:
    from shardio.storage import _fastread

    with pytest.raises((ValueError, TypeError, BufferError)):
        _fastread.stop_reads(bad)
    if bad is not None:
        with pytest.raises((ValueError, TypeError, BufferError)):
            _fastread.pread_many([], False, bad)
