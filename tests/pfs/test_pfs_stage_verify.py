"""From the MooseFS bed: ``shardio stage`` to local disk and reads served by the area;
``shardio verify`` and ``verify --repair`` of a shard damaged through the mount; and
ResilientDataset (policy skip) over that damaged shard."""

from __future__ import annotations

import collections
import json
import pathlib
import shutil
from typing import Any

import pytest
from mfsbed import PfsDataset
from trees import flip_member

from shardio import RecoveryPolicy, ShardDataset
from shardio.format.manifest import load_manifest
from shardio.order.ranks import RankInfo
from shardio.read.journal import read_journal

W = ("--workers", "2", "--no-progress")
SINGLE = RankInfo(rank=0, world_size=1)
BATCH = 16


def files_of(root: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def shard_rels(root: pathlib.Path) -> list[str]:
    return [s.path for s in load_manifest(root / "manifest.json").shards]


@pytest.fixture
def damaged(pfs_dataset: PfsDataset, pfs_dir: pathlib.Path) -> tuple[pathlib.Path, str, str]:
    """A copy of the session's dataset on the mount with one member of shard 2 flipped
    (written through the mount: the chunkservers store the bad bytes). Returns (copy, the
    shard's path, the damaged sample's key)."""
    dst = pfs_dir / "ds"
    shutil.copytree(pfs_dataset.path, dst)
    key = flip_member(dst, 2)
    return dst, shard_rels(dst)[2], key


@pytest.mark.parametrize("mode", ["map", "stream"])
def test_stage_from_the_pfs_then_read_the_area(
    pfs_dataset: PfsDataset, tmp_path: pathlib.Path, run_cli: Any, mode: str
) -> None:
    area = tmp_path / "area"
    rc, _, err = run_cli("stage", pfs_dataset.path, area, "--mode", mode, "--no-progress")
    assert rc == 0, err
    shards = shard_rels(pfs_dataset.path)
    for rel in shards:  # every shard staged, byte-identical to the PFS copy
        assert (area / rel).read_bytes() == (pfs_dataset.path / rel).read_bytes(), rel
    ds = ShardDataset(pfs_dataset.path, mode=mode, stage=area, ranks=SINGLE, seed=2)
    loader = ds.loader(batch_size=BATCH, num_workers=2)
    try:
        keys = []
        for batch in loader:
            for i, key in enumerate(batch["__key__"]):
                assert bytes(batch["jpeg"][i]) == pfs_dataset.payload[key], key
                keys.append(key)
        snap = loader.metrics()
    finally:
        loader.close()
        ds.close()
    assert sorted(keys) == sorted(pfs_dataset.payload)
    assert snap.bytes_source == 0  # nothing read from the PFS: the area served it all
    assert snap.bytes_staged == sum(len(v) for v in pfs_dataset.payload.values())
    assert snap.counters["opens_source"] == 0
    assert snap.counters["cache_hits"] >= len(shards)
    rc, out, err = run_cli("stage", "--clean", area)
    assert rc == 0, err
    assert out.startswith(f"removed {len(shards)} staged shard(s)"), out


def test_verify_and_repair_on_the_pfs(
    pfs_dataset: PfsDataset, damaged: tuple[pathlib.Path, str, str], run_cli: Any
) -> None:
    rc, out, err = run_cli("verify", pfs_dataset.path, *W)
    assert rc == 0, err
    assert out.startswith("OK: verified"), out

    dst, rel, key = damaged
    rc, _, err = run_cli("verify", dst, *W)
    assert rc == 3, err
    assert f"DAMAGED {rel}: 1 damaged member(s)" in err
    assert f"sample {key} " in err

    rc, out, err = run_cli("verify", dst, "--repair", "--source", pfs_dataset.path, "--json", *W)
    assert rc == 4, err
    report = json.loads(out)
    assert report["status"] == "repaired"
    assert [r["shard"] for r in report["repaired"]] == [rel]
    assert report["unrepaired"] == []
    assert files_of(dst) == files_of(pfs_dataset.path)

    rc, out, err = run_cli("verify", dst, *W)
    assert rc == 0, err
    assert not [p for p in dst.rglob("*") if "shardio-tmp" in p.name]


@pytest.mark.parametrize(("mode", "workers"), [("map", 2), ("stream", 0)])
def test_resilient_dataset_substitutes_the_damaged_shards_samples(
    damaged: tuple[pathlib.Path, str, str],
    pfs_dataset: PfsDataset,
    tmp_path: pathlib.Path,
    mode: str,
    workers: int,
) -> None:
    dst, rel, bad_key = damaged
    journal = tmp_path / "repairs.jsonl"
    ds = ShardDataset(
        dst,
        mode=mode,
        ranks=SINGLE,
        seed=4,
        recovery=RecoveryPolicy(policy="skip", retries=1, backoff_s=0.0, journal=str(journal)),
    )
    loader = ds.loader(batch_size=BATCH, num_workers=workers)
    try:
        keys = []
        for batch in loader:
            for i, key in enumerate(batch["__key__"]):
                assert bytes(batch["jpeg"][i]) == pfs_dataset.payload[key], f"wrong bytes: {key}"
                keys.append(key)
        snap = loader.metrics()
    finally:
        loader.close()
        ds.close()
    assert len(keys) == len(pfs_dataset.payload)  # the count stays the same
    skipped = [e for e in read_journal(journal) if e["event"] == "skip"]
    assert [e["key"] for e in skipped] == [bad_key]
    assert all(e["shard"] == rel for e in skipped)
    delivered = collections.Counter(keys)
    assert delivered[bad_key] == 0
    assert snap.counters["checksum_failures"] >= 1
    assert snap.counters["substitutes"] == 1
