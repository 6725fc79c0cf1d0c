"""Re-staging a bad staged copy on read (ResilientDataset): once per node, verified, and never
through a symlink planted in the staging area."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import shutil

from shardio import RecoveryPolicy
from shardio.format.checksum import file_xxh3_128
from shardio.read.journal import read_journal
from shardio.read.reader import ShardReader
from shardio.runtime.dataset import ShardDataset
from shardio.staging import StageOptions, stage_dataset
from shardio.staging.protocol import stamp_matches, write_stamp

from .test_damage import SINGLE, _flip


def _stage_all(src, dest) -> None:
    stage_dataset(src.path, dest, StageOptions(durable=False))


def _rot(src, dest: pathlib.Path, sample: int) -> str:
    """Silent corruption (bit rot): flip a byte and refresh the stamp so stat shows nothing."""
    rel = _flip(src, dest, sample)
    entry = next(s for s in src.manifest.shards if s.path == rel)
    write_stamp(os.fspath(dest), rel, entry.xxh3_128, False)
    return rel


def _read_shard(args: tuple[str, str, list[int], int]) -> list[bytes]:
    src, dest, samples, _worker = args
    ds = ShardDataset(
        src, stage=dest, ranks=SINGLE, recovery=RecoveryPolicy(policy="raise", backoff_s=0.0)
    )
    return [ds[i]["bin"] for i in samples]


def test_many_readers_restage_a_bad_copy_once(big_src, tmp_path):
    dest = tmp_path / "stage"
    _stage_all(big_src, dest)
    sample = len(big_src.keys) // 2
    rel = _rot(big_src, dest, sample)
    samples = big_src.samples_in(rel)
    jobs = [(os.fspath(big_src.path), os.fspath(dest), samples, w) for w in range(6)]
    with multiprocessing.get_context("fork").Pool(6) as pool:
        results = pool.map(_read_shard, jobs)
    for got in results:
        assert got == [big_src.payload[big_src.keys[i]] for i in samples]
    events = read_journal(dest / ".shardio-stage" / "repairs.jsonl")
    copied = [e for e in events if e["event"] == "restage" and e["outcome"] == "copied"]
    assert len(copied) == 1, events
    assert all(e["shard"] == rel for e in events)
    entry = next(s for s in big_src.manifest.shards if s.path == rel)
    assert file_xxh3_128(os.fspath(dest / rel)) == entry.xxh3_128
    assert stamp_matches(os.fspath(dest), rel, entry.xxh3_128)
    # once repaired, a new reader takes the staged copy again
    with ShardReader(big_src.path, stage=dest) as ds:
        assert ds.shard_path(big_src.rels.index(rel)) == os.fspath(dest / rel)


def test_a_deleted_copy_is_staged_again(big_src, tmp_path):
    dest = tmp_path / "stage"
    _stage_all(big_src, dest)
    rel = big_src.rels[1]
    # The stamp still matches nothing once the file is gone: delete it while a reader has
    # already decided to read the copy.
    ds = ShardDataset(
        big_src.path,
        stage=dest,
        ranks=SINGLE,
        recovery=RecoveryPolicy(policy="raise", backoff_s=0.0),
    )
    first = big_src.samples_in(rel)[0]
    ds.packed.resolver.locate(big_src.rels.index(rel))
    os.unlink(dest / rel)
    assert ds[first]["bin"] == big_src.payload[big_src.keys[first]]
    assert ds.recovery_stats["restage"] == 1
    assert stamp_matches(os.fspath(dest), rel, big_src.manifest.shards[1].xxh3_128)


def test_restage_never_writes_through_a_symlinked_folder(big_src, tmp_path):
    dest = tmp_path / "stage"
    _stage_all(big_src, dest)
    sample = len(big_src.keys) // 2
    rel = _rot(big_src, dest, sample)
    folder = dest / os.path.dirname(rel)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(folder, elsewhere)
    folder.symlink_to(elsewhere)
    before = {p.name: p.stat().st_mtime_ns for p in elsewhere.iterdir()}
    ds = ShardDataset(
        big_src.path,
        stage=dest,
        ranks=SINGLE,
        recovery=RecoveryPolicy(policy="raise", backoff_s=0.0),
    )
    # The staged copies behind the symlink are not trusted; the source is read.
    assert ds[sample]["bin"] == big_src.payload[big_src.keys[sample]]
    after = {p.name: p.stat().st_mtime_ns for p in elsewhere.iterdir()}
    assert after == before  # nothing written, replaced or removed through the link
    assert folder.is_symlink()
