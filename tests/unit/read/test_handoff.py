"""Staging decisions made once and handed on (ShardResolver.decide, ShardReader.handoff),
and stamps read once while unchanged (StampCache): a decision gone stale costs a fallback to
the source, never a wrong byte, and never a symlink followed."""

from __future__ import annotations

import errno
import multiprocessing
import os
import pathlib
import pickle
import shutil

import pytest

from shardio.errors import FormatError, ReadStalledError
from shardio.read.reader import ShardReader
from shardio.staging.protocol import StampCache, stamp_path, write_stamp
from shardio.staging.stage import StageOptions, stage_dataset
from shardio.storage.opener import PosixOpener


@pytest.fixture
def staged(packed_small, tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(dataset, staging area holding a verified copy of every shard)."""
    src = packed_small("tar", "256KiB")[0]
    area = tmp_path / "area"
    stage_dataset(src, area, StageOptions())
    return src, area


def _flip_first_member(ds: ShardReader, path: str) -> None:
    """Flip a byte of sample 0's first member in the file at ``path``."""
    offset = int(ds.index.members[ds.index.sample_member_range(0)[0]]["offset"])
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_a_decided_copy_damaged_since_costs_a_fallback_not_a_byte(staged) -> None:
    src, area = staged
    with ShardReader(src) as clean:
        expected = clean.read_sample(0)
    with ShardReader(src, stage=area) as ds:
        ds.decide(range(len(ds)))
        assert ds.resolver.handed() == frozenset(range(len(ds.manifest.shards)))
        copy = ds.shard_path(0)
        _flip_first_member(ds, copy)  # the stamp no longer matches; the decision says staged
        assert ds.resolver.locate(0).staged
        assert ds.read_sample(0) == expected
        assert ds.metrics["checksum_failures"] == 1
        assert ds.metrics["drops"] == 1
        assert not ds.resolver.locate(0).staged
        assert not os.path.exists(copy), "the damaged copy was kept"


def test_a_decided_copy_replaced_by_a_symlink_is_not_followed(staged, tmp_path) -> None:
    src, area = staged
    with ShardReader(src) as clean:
        expected = clean.read_sample(0)
        source = clean.shard_path(0)
    with ShardReader(src, stage=area) as ds:
        ds.decide([0])
        copy = ds.shard_path(0)
        os.unlink(copy)
        os.symlink(source, copy)  # the right bytes, but not a file staging wrote
        assert ds.read_sample(0) == expected
        assert ds.metrics["bytes_staged"] == 0, "read through the symlink"
        assert ds.metrics["read_errors"] == 1
        assert os.path.islink(copy), "shardio removed a symlink it did not create"


def test_forget_checks_a_handed_shard_again(staged) -> None:
    src, area = staged
    with ShardReader(src, stage=area) as ds:
        ds.decide([0, 1])
        os.unlink(stamp_path(str(area), ds.manifest.shards[0].path))
        assert ds.resolver.locate(0).staged  # decided: not checked again
        ds.resolver.forget(0)
        assert not ds.resolver.locate(0).staged
        assert ds.resolver.locate(1).staged


def test_without_a_staging_area_decide_is_a_no_op(staged) -> None:
    src, _area = staged
    with ShardReader(src) as ds:
        ds.decide(range(len(ds)))
        assert ds.resolver.handed() == frozenset()
        assert not ds.resolver.locate(0).staged


def test_a_handoff_carries_the_manifest_and_decisions_but_the_index_is_checked(
    staged, tmp_path
) -> None:
    src, area = staged
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    with ShardReader(copy, stage=area) as parent:
        parent.decide(range(len(parent)))
        handoff = pickle.loads(pickle.dumps(parent.handoff()))
        expected = [parent.read_sample(i) for i in range(3)]
    assert handoff.staged == frozenset(range(len(handoff.manifest.shards)))
    (copy / "manifest.json").write_bytes(b"not read again")
    with ShardReader(copy, stage=area, handoff=handoff) as child:
        assert child.resolver.handed() == handoff.staged
        assert [child.read_sample(i) for i in range(3)] == expected
        assert child.metrics["cache_hits"] >= 1
    index = copy / handoff.manifest.index.path
    data = bytearray(index.read_bytes())
    data[8] ^= 0xFF  # the header: checked against the manifest at open
    index.write_bytes(bytes(data))
    with pytest.raises(FormatError):
        ShardReader(copy, stage=area, handoff=handoff)


def test_stamp_cache_reads_a_stamp_again_once_it_is_replaced(staged) -> None:
    src, area = staged
    with ShardReader(src) as ds:
        entry = ds.manifest.shards[0]
    dest = str(area)
    stamps = StampCache()
    assert stamps.matches(dest, entry.path, entry.xxh3_128)
    assert stamps.matches(dest, entry.path, entry.xxh3_128)  # from what was read
    write_stamp(dest, entry.path, "0" * 32, durable=False)  # published by rename: a new file
    assert not stamps.matches(dest, entry.path, entry.xxh3_128)
    write_stamp(dest, entry.path, entry.xxh3_128, durable=False)
    assert stamps.matches(dest, entry.path, entry.xxh3_128)
    stamp = stamp_path(dest, entry.path)
    real = stamp + ".real"
    os.rename(stamp, real)
    os.symlink(real, stamp)  # a valid stamp behind a symlink is no stamp
    assert not stamps.matches(dest, entry.path, entry.xxh3_128)
    os.unlink(stamp)
    assert not stamps.matches(dest, entry.path, entry.xxh3_128)
    os.rename(real, stamp)
    assert stamps.matches(dest, entry.path, entry.xxh3_128)
    with open(os.path.join(dest, entry.path), "r+b") as fh:  # the copy written: ctime moves
        first = fh.read(1)
        fh.seek(0)
        fh.write(first)
    assert not stamps.matches(dest, entry.path, entry.xxh3_128)


# -- descriptors handed on over fork (ShardReader.open_ahead) ---------------------------------


def _first_sample_of(ds: ShardReader, shard: int) -> int:
    return int(sum(s.num_samples for s in ds.manifest.shards[:shard]))


def test_open_ahead_opens_source_shards_in_order_while_the_pool_has_room(packed_small) -> None:
    src = packed_small("tar", "256KiB")[0]
    with ShardReader(src, max_open=3) as ds:
        shards = len(ds.manifest.shards)
        assert shards > 3
        order = list(reversed(range(shards)))
        assert ds.open_ahead(order) == 3
        assert [ds.pool.holds(ds.shard_path(s)) for s in order[:4]] == [True] * 3 + [False]
        assert ds.metrics["opens_source"] == 3
        assert ds.open_ahead(order[:3]) == 0, "held ones are not opened again"
    with ShardReader(src) as ds:
        assert ds.open_ahead(range(len(ds.manifest.shards)), limit=2) == 2
        assert ds.pool.held == 2


class _HoldsShardOne(PosixOpener):
    """Refuses shard 1 as a deadline opener refuses a path held unavailable after a stall
    (``waited_s`` 0), or as one whose open stalled (``waited_s`` > 0)."""

    def __init__(self, waited_s: float) -> None:
        super().__init__()
        self.waited_s = waited_s

    def open(self, path: str, *, nofollow: bool = False) -> int:
        if path.endswith("shard-000001.tar"):
            exc = ReadStalledError(errno.ETIMEDOUT, f"opening {path}: not attempted")
            exc.waited_s = self.waited_s
            raise exc
        return super().open(path, nofollow=nofollow)


@pytest.mark.parametrize(("waited_s", "opened"), [(0.0, 2), (5.0, 1)])
def test_open_ahead_passes_over_a_held_shard_and_stops_at_a_stalled_one(
    packed_small, waited_s, opened
) -> None:
    src = packed_small("tar", "256KiB")[0]
    with ShardReader(src, opener=_HoldsShardOne(waited_s)) as ds:
        assert ds.open_ahead([0, 1, 2]) == opened
        assert ds.pool.holds(ds.shard_path(2)) == (opened == 2)


def test_open_ahead_leaves_staged_copies_to_their_readers(staged) -> None:
    src, area = staged
    with ShardReader(src, stage=area) as ds:
        ds.decide(range(len(ds)))
        assert ds.open_ahead(range(len(ds.manifest.shards))) == 0
        assert ds.metrics["opens_staged"] == 0


def _copy(packed_small, tmp_path) -> pathlib.Path:  # type: ignore[no-untyped-def]
    """A copy of the small tar dataset to damage."""
    src = tmp_path / "ds"
    shutil.copytree(packed_small("tar", "256KiB")[0], src)
    return src


def test_open_ahead_passes_over_shards_that_cannot_be_opened_a_few_times(
    packed_small, tmp_path
) -> None:
    with ShardReader(_copy(packed_small, tmp_path)) as ds:
        assert len(ds.manifest.shards) >= 7
        for shard in (1, 3, 4, 5):
            os.unlink(ds.shard_path(shard))
        # 0 and 2 opened; 1, 3, 4 passed over; the fourth failure (5) ends it before 6.
        assert ds.open_ahead(range(7)) == 2
        assert [ds.pool.holds(ds.shard_path(s)) for s in (0, 2, 6)] == [True, True, False]
        with pytest.raises(OSError, match="shard-000001"):
            ds.read_sample(_first_sample_of(ds, 1))


def _read_in_child(ds: ShardReader, sample: int, conn) -> None:
    try:
        counter = (
            "opens_staged" if ds.resolver.locate(ds.shard_of(sample)).staged else ("opens_source")
        )
        before = ds.metrics[counter]
        data = ds.read_sample(sample)
        conn.send(("ok", ds.metrics[counter] - before, data))
    except Exception as exc:
        conn.send(("error", type(exc).__name__, str(exc)))
    finally:
        conn.close()


def _fork_read(ds: ShardReader, sample: int):
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_read_in_child, args=(ds, sample, child))
    proc.start()
    child.close()
    got = parent.recv() if parent.poll(60) else ("timeout", None, None)
    proc.join(30)
    return got


def test_a_forked_reader_reads_through_inherited_descriptors_and_still_checks_bytes(
    packed_small, tmp_path
) -> None:
    with ShardReader(_copy(packed_small, tmp_path)) as ds:
        expected = ds.read_sample(0)
        ds.pool.close()
        assert ds.open_ahead([0]) == 1
        status, opens, data = _fork_read(ds, 0)
        assert (status, opens) == ("ok", 0), data
        assert data == expected
        # The same open file, damaged in place: the inherited descriptor's bytes are checked
        # after they are read, like any others.
        _flip_first_member(ds, ds.shard_path(0))
        status, kind, message = _fork_read(ds, 0)
        assert (status, kind) == ("error", "ChecksumMismatchError"), message
        assert "shard-000000" in message


def test_a_forked_reader_opens_staged_copies_itself(staged) -> None:
    """The parent's descriptor of a copy may name one dropped and staged again since: a
    forked reader opens (and locks) its own."""
    src, area = staged
    with ShardReader(src, stage=area) as ds:
        expected = ds.read_sample(0)
        assert ds.metrics["opens_staged"] == 1
        status, opens, data = _fork_read(ds, 0)
        assert (status, opens) == ("ok", 1), data
        assert data == expected
