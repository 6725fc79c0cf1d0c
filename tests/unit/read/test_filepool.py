"""FilePool: a pool let go without close() closes its descriptors when collected.

Found by the soak (benchmarks/bench_soak.py): a stream-mode ShardDataset opens its epoch's
shards in the training process before its workers fork; dropped without ``close()`` (a
dataset made per evaluation and let go), every one of them stayed open until the process
ended, since the pool keeps plain int descriptors.
"""

from __future__ import annotations

import gc
import os
import pathlib
from collections.abc import Callable
from typing import Any

from shardio.read.deadline import DeadlineOpener
from shardio.read.filepool import FilePool
from shardio.storage.opener import PosixOpener


def _open_fds() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return found


def test_a_dropped_pool_closes_its_descriptors(tmp_path: pathlib.Path) -> None:
    paths = []
    for i in range(5):
        path = tmp_path / f"shard-{i}.tar"
        path.write_bytes(b"x" * 100)
        paths.append(str(path))
    pool = FilePool(PosixOpener(), max_open=8)
    fds = [pool.fd(p) for p in paths]
    assert set(paths) <= _open_fds()
    del pool
    gc.collect()
    assert not set(paths) & _open_fds()
    for fd in fds:  # closed, not merely forgotten
        try:
            os.fstat(fd)
        except OSError:
            continue
        assert os.readlink(f"/proc/self/fd/{fd}") not in paths


def test_close_then_collection_closes_nothing_twice(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "shard.tar"
    path.write_bytes(b"x")
    pool = FilePool(PosixOpener())
    pool.fd(str(path))
    pool.close()
    assert str(path) not in _open_fds()
    mine = os.open(str(path), os.O_RDONLY)  # may reuse the number the pool had
    try:
        del pool
        gc.collect()
        os.fstat(mine)  # still open: the collected pool did not close it again
    finally:
        os.close(mine)


def test_a_dropped_stream_dataset_leaves_no_shard_open(packed_small: Callable[..., Any]) -> None:
    from shardio import ShardDataset

    root = str(packed_small()[0])
    before = {p for p in _open_fds() if p.startswith(root)}
    ds = ShardDataset(root, mode="stream", seed=0)
    for _ in ds.loader(batch_size=64, num_workers=1):
        pass
    del ds, _
    gc.collect()
    assert {p for p in _open_fds() if p.startswith(root)} == before


def test_a_pool_adopts_duplicates_of_sources_not_staged_copies_within_its_room(
    tmp_path: pathlib.Path,
) -> None:
    """A reader thread's pool reads through duplicates of the training process's sources
    (no open reaches the filesystem); a staged copy is locked by each reader itself."""
    from shardio.read.faults import FaultyOpener

    paths = []
    for i in range(4):
        path = tmp_path / f"shard-{i}.tar"
        path.write_bytes(bytes([i]) * 100)
        paths.append(str(path))
    main = FilePool(PosixOpener(), max_open=8)
    for p in paths[:3]:
        main.fd(p)
    main.fd(paths[3], staged=True)
    opens = main.metrics.counts.get("opens_source", 0)
    mine = FilePool(FaultyOpener([]), max_open=2)
    assert mine.adopt(main) == 2  # its room
    assert mine.metrics.counts.get("opens_source", 0) == 0
    held = [p for p in paths if mine.holds(p)]
    assert held == paths[:2] and not mine.holds(paths[3])
    for i, p in enumerate(held):
        fd = mine.fd(p)
        assert fd != main.fd(p)
        target = memoryview(bytearray(100))
        assert mine.opener.pread_into(fd, target, 0) == 100 and bytes(target) == bytes([i]) * 100
    mine.close()  # its duplicates only
    assert all(os.fstat(main.fd(p)).st_size == 100 for p in paths[:3])
    assert main.metrics.counts.get("opens_source", 0) == opens

    class NoDup:  # an opener of a caller's that predates dup: nothing adopted, opened instead
        def open(self, path: str, *, nofollow: bool = False) -> int:
            return os.open(path, os.O_RDONLY)

        def close(self, fd: int) -> None:
            os.close(fd)

    plain = FilePool(NoDup(), max_open=8)  # type: ignore[arg-type]
    assert plain.adopt(main) == 0
    # Behind a deadline (read_timeout_s), the same opener opens each path again, bounded.
    bounded = FilePool(DeadlineOpener(NoDup(), timeout_s=5), max_open=8)  # type: ignore[arg-type]
    assert bounded.adopt(main) == 3
    assert all(os.fstat(bounded.fd(p)).st_size == 100 for p in paths[:3])
    bounded.close()
    main.close()
