"""shardio.dali on CPU-only DALI pipelines: the same samples as ShardDataset, checked bytes.

Every pipeline here runs with ``device_id=None``. The verified path (shardio's reader feeding
``fn.external_source``) must deliver ShardDataset's samples in ShardDataset's order; DALI's
own tar reader (``verify=False``) must deliver the dataset's bytes and labels, in its order.
"""

from __future__ import annotations

import collections
import io
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("nvidia.dali")

import shardio.dali as sdali
from shardio.errors import ChecksumMismatchError, UsageError
from shardio.order.ranks import RankInfo
from shardio.runtime.dataset import ShardDataset
from shardio.staging.stage import StageOptions, stage_dataset

pytestmark = pytest.mark.dali

Packed = Any  # tests/unit/runtime/conftest.py's Packed (a conftest is not imported by name)

BATCH = 64  # 600 samples: 9 full batches and one of 24


def _epoch(loader: Iterable[dict[str, Any]]) -> tuple[list[bytes], list[int], list[int]]:
    """One loop of a loader: (bytes per sample, label per sample, batch sizes)."""
    data: list[bytes] = []
    labels: list[int] = []
    sizes: list[int] = []
    for batch in loader:
        assert set(batch) == {"data", "label"}
        label = batch["label"]
        assert isinstance(label, torch.Tensor) and label.dtype == torch.int64
        assert label.shape == (len(batch["data"]),)
        data += [bytes(t.numpy()) for t in batch["data"]]
        labels += label.tolist()
        sizes.append(len(batch["data"]))
    return data, labels, sizes


def _expected(
    packed: Packed,
    *,
    seed: int,
    epoch: int,
    ranks: RankInfo,
    drop_last: bool = False,
    spec: str | None = None,
) -> tuple[list[bytes], list[int]]:
    """What ShardDataset delivers to ``ranks`` in ``epoch``: (bytes, labels) in order."""
    if spec is not None:
        ds = ShardDataset(packed.path, order=spec, ranks=ranks)
    else:
        ds = ShardDataset(packed.path, seed=seed, ranks=ranks, drop_last=drop_last)
    try:
        ds.set_epoch(epoch)
        samples = [ds[int(i)] for i in ds.rank_indices()]
    finally:
        ds.close()
    for sample in samples:
        packed.check_sample(sample)
    return [s["jpeg"] for s in samples], [s["cls"] for s in samples]


def _unverified(path: Path, **kwargs: Any) -> sdali.DALILoader:
    with pytest.warns(sdali.UnverifiedReadWarning, match="no byte is checked"):
        return sdali.loader(path, verify=False, **kwargs)


# -- the verified path: ShardDataset's samples, in its order ----------------------------------
def test_verified_pipeline_delivers_shard_dataset_samples(packed: Packed) -> None:
    with sdali.loader(packed.path, batch_size=BATCH, seed=7, shard_id=0, num_shards=1) as loader:
        assert loader.pipeline.verified
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            data, labels, sizes = _epoch(loader)
            want = _expected(packed, seed=7, epoch=epoch, ranks=RankInfo())
            assert data == want[0], f"epoch {epoch}: bytes or order differ from ShardDataset"
            assert labels == want[1]
            assert sizes == [BATCH] * 9 + [24]
            assert len(loader) == len(sizes)
        assert _epoch(loader)[0] == data  # no set_epoch: the same epoch again


def test_no_shuffle_reads_in_dataset_order(packed_tar: Packed) -> None:
    with sdali.loader(packed_tar.path, batch_size=100, shuffle=False) as loader:
        data, labels, _ = _epoch(loader)
    assert data == [packed_tar.payload[k] for k in packed_tar.keys]
    assert labels == [packed_tar.label[k] for k in packed_tar.keys]


@pytest.mark.parametrize(("world", "drop_last"), [(2, False), (7, False), (7, True)])
def test_ranks_split_like_shard_dataset(packed_hdf5: Packed, world: int, drop_last: bool) -> None:
    got: list[bytes] = []
    counts = set()
    for rank in range(world):
        ranks = RankInfo(rank=rank, world_size=world)
        with sdali.loader(
            packed_hdf5.path,
            batch_size=32,
            seed=3,
            shard_id=rank,
            num_shards=world,
            drop_last=drop_last,
        ) as loader:
            data, labels, _ = _epoch(loader)
            assert len(loader) == -(-len(data) // 32)
        assert (data, labels) == _expected(
            packed_hdf5, seed=3, epoch=0, ranks=ranks, drop_last=drop_last
        )
        counts.add(len(data))
        got += data
    n = len(packed_hdf5.keys)
    assert counts == {n // world if drop_last else -(-n // world)}  # equal on every rank
    everything = {packed_hdf5.payload[k] for k in packed_hdf5.keys}
    if world == 2:
        assert sorted(got) == sorted(everything)  # exactly once
    elif drop_last:
        assert len(set(got)) == len(got)  # nothing repeats
    else:
        assert set(got) == everything  # padded by repeats, nothing missing


def test_ranks_default_to_the_detected_world(
    packed_tar: Packed, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with sdali.loader(packed_tar.path, batch_size=50, seed=5) as loader:
        assert (loader.pipeline.ranks.rank, loader.pipeline.ranks.world_size) == (1, 3)
        data, labels, _ = _epoch(loader)
    assert (data, labels) == _expected(
        packed_tar, seed=5, epoch=0, ranks=RankInfo(rank=1, world_size=3)
    )


def test_a_loop_left_early_restarts_its_epoch(packed_tar: Packed) -> None:
    with sdali.loader(packed_tar.path, batch_size=BATCH, seed=1) as loader:
        for i, _batch in enumerate(loader):
            if i == 2:
                break
        loader.set_epoch(4)
        data, _, _ = _epoch(loader)
    assert data == _expected(packed_tar, seed=1, epoch=4, ranks=RankInfo())[0]


def test_a_loop_left_early_continues_after_its_last_batch(packed_tar: Packed) -> None:
    want = _expected(packed_tar, seed=1, epoch=0, ranks=RankInfo())[0]
    with sdali.loader(packed_tar.path, batch_size=BATCH, seed=1) as loader:
        head: list[bytes] = []
        for i, batch in enumerate(loader):
            head += [bytes(t.numpy()) for t in batch["data"]]
            if i == 2:
                break
        rest, _, _ = _epoch(loader)  # a fresh DALI pipeline, after the delivered batches
        assert head + rest == want
        assert _epoch(loader)[0] == want  # a finished epoch, no set_epoch: read again


@pytest.mark.parametrize("spec", ["order=random,seed=4", "order=shard-local,seed=4,window=2"])
def test_mid_epoch_resume_in_a_new_loader_delivers_exactly_the_rest(
    packed_tar: Packed, spec: str
) -> None:
    ds = ShardDataset(packed_tar.path, order=spec, ranks=RankInfo())
    ds.set_epoch(2)
    want = [ds[int(i)]["jpeg"] for i in ds.rank_indices()]
    ds.close()
    with sdali.loader(packed_tar.path, batch_size=BATCH, order=spec) as first:
        first.set_epoch(2)
        head: list[bytes] = []
        for i, batch in enumerate(first):
            head += [bytes(t.numpy()) for t in batch["data"]]
            if i == 3:
                break
        state = first.state_dict()
    assert state["consumed"] == 4 * BATCH and state["epoch"] == 2
    with sdali.loader(packed_tar.path, batch_size=BATCH, order=spec) as second:
        second.load_state_dict(state)
        rest, _, _ = _epoch(second)
    assert head + rest == want
    # The state is ShardDataset's: a ShardDataset resumes from the DALI loader's.
    again = ShardDataset(packed_tar.path, order=spec, ranks=RankInfo())
    again.load_state_dict(state)
    assert [again[int(i)]["jpeg"] for i in again.rank_indices(consumed=state["consumed"])] == rest
    again.close()


def test_a_node_partition_reads_what_shard_dataset_reads_per_rank(
    packed_tar: Packed, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 4 ranks on 2 nodes: each node's ranks read only that node's shards (what
    # ``shardio stage --node`` staged for it), the same samples as ShardDataset's.
    spec = "order=random,seed=9,partition=node"
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    by_node: dict[int, set[bytes]] = collections.defaultdict(set)
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        ds = ShardDataset(packed_tar.path, order=spec)
        ds.set_epoch(1)
        want = [ds[int(i)]["jpeg"] for i in ds.rank_indices()]
        ds.close()
        with sdali.loader(packed_tar.path, batch_size=BATCH, order=spec) as loader:
            assert loader.pipeline.ranks.node_size == 2
            loader.set_epoch(1)
            data, _, _ = _epoch(loader)
        assert data == want, f"rank {rank}"
        by_node[rank // 2] |= set(data)
    assert not by_node[0] & by_node[1]  # the nodes read disjoint shards


def _clear_rank_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)


def _node_share(packed: Packed, spec: str, node: int, epoch: int) -> set[int]:
    """The shards ``shardio stage --node NODE/2`` stages for 2 ranks per node."""
    from shardio.format.manifest import load_manifest
    from shardio.order.spec import resolve_spec
    from shardio.staging.options import StageOptions
    from shardio.staging.plan import node_shard_order

    options = StageOptions(node=node, num_nodes=2, ranks_per_node=2, epoch=epoch,
                           spec=resolve_spec("map", spec))  # fmt: skip
    return set(node_shard_order(load_manifest(packed.path / "manifest.json"), options))


@pytest.mark.parametrize(
    "layout",
    [
        {"LOCAL_WORLD_SIZE": "2"},  # torchrun's
        {"SLURM_NTASKS_PER_NODE": "2"},  # SLURM's
        {"SLURM_NTASKS_PER_NODE": "2(x2)"},
        "ranks",  # ShardDataset's RankInfo, given whole
    ],
)
def test_given_ranks_keep_the_node_layout_under_a_node_partition(
    packed_tar: Packed, monkeypatch: pytest.MonkeyPatch, layout: Any
) -> None:
    """shard_id/num_shards with the environment's ranks per node (or ``ranks=``): on each
    rank of 2 nodes of 2 ranks, DALI reads ShardDataset's samples, and the node's ranks
    together read exactly the node's staged share, not every shard on every node."""
    spec = "order=random,seed=5,partition=node"
    _clear_rank_env(monkeypatch)
    if isinstance(layout, dict):
        for name, value in layout.items():
            monkeypatch.setenv(name, value)
    first_shard = np.cumsum([0, *packed_tar.shard_sizes])[:-1]
    read: dict[int, set[int]] = collections.defaultdict(set)
    for rank in range(4):
        ranks = RankInfo(rank=rank, world_size=4, ranks_per_node=2)
        how = {"ranks": ranks} if layout == "ranks" else {"shard_id": rank, "num_shards": 4}
        with sdali.loader(packed_tar.path, batch_size=BATCH, order=spec, device_id=None,
                          **how) as loader:  # fmt: skip
            assert (loader.pipeline.ranks.node, loader.pipeline.ranks.num_nodes) == (rank // 2, 2)
            loader.set_epoch(1)
            indices = loader.pipeline.rank_indices()
            data, labels, _ = _epoch(loader)
        assert (data, labels) == _expected(packed_tar, seed=5, epoch=1, ranks=ranks,
                                           spec=spec), f"rank {rank}"  # fmt: skip
        read[rank // 2] |= set((np.searchsorted(first_shard, indices, side="right") - 1).tolist())
    for node in (0, 1):
        assert read[node] == _node_share(packed_tar, spec, node, epoch=1), f"node {node}"
    assert not read[0] & read[1]


def test_a_node_layout_that_does_not_fit_the_given_world_is_refused(
    packed_tar: Packed, monkeypatch: pytest.MonkeyPatch
) -> None:
    _clear_rank_env(monkeypatch)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(UsageError, match="LOCAL_WORLD_SIZE=8 is more than the world size 4"):
        sdali.pipeline(packed_tar.path, batch_size=4, shard_id=0, num_shards=4, device_id=None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(UsageError, match="not both"):
        sdali.pipeline(packed_tar.path, batch_size=4, shard_id=0, num_shards=4,
                       ranks=RankInfo(), device_id=None)  # fmt: skip
    with pytest.raises(UsageError, match="RankInfo"):
        sdali.pipeline(packed_tar.path, batch_size=4, ranks=(0, 4), device_id=None)  # type: ignore[arg-type]


def test_a_partition_on_dalis_own_reader_is_refused(packed_tar: Packed) -> None:
    with pytest.raises(UsageError, match="partition='node' needs verify=True"):
        sdali.pipeline(packed_tar.path, batch_size=4, verify=False, order="partition=node")


def test_dalis_own_reader_has_no_resumable_state(packed_tar: Packed) -> None:
    with (
        _unverified(packed_tar.path, batch_size=BATCH) as loader,
        pytest.raises(UsageError, match="no resumable order"),
    ):
        loader.state_dict()


def test_reads_verified_copies_from_a_staging_area(packed_tar: Packed, tmp_path: Path) -> None:
    area = tmp_path / "area"
    stage_dataset(packed_tar.path, area, StageOptions())
    with sdali.loader(packed_tar.path, batch_size=BATCH, seed=2, stage=area) as loader:
        data, labels, _ = _epoch(loader)
        stats = loader.pipeline.read_metrics().counts
    assert (data, labels) == _expected(packed_tar, seed=2, epoch=0, ranks=RankInfo())
    assert stats["cache_hits"] == packed_tar.num_shards and stats["cache_misses"] == 0
    assert stats["bytes_source"] == 0 and stats["bytes_staged"] > 0


def test_loader_metrics_count_the_verified_reads_and_the_loop(packed_tar: Packed) -> None:
    with sdali.loader(packed_tar.path, batch_size=BATCH, seed=2) as loader:
        data, _labels, _ = _epoch(loader)
        snap = loader.metrics()
    assert snap.samples == snap.samples_read == len(data) == len(packed_tar.keys)
    assert snap.batches == -(-len(data) // BATCH)
    assert snap.read_latency["source"].count == len(data)
    assert snap.bytes_read == sum(len(d) for d in data)
    assert 0.0 <= snap.stall_fraction <= 1.0


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_a_flipped_byte_raises_checksum_mismatch(
    fmt: str,
    request: pytest.FixtureRequest,
    corrupt_copy: Callable[[Packed, str], tuple[Packed, str, int]],
) -> None:
    packed: Packed = request.getfixturevalue(f"packed_{fmt}")
    key = packed.keys[len(packed.keys) // 2]
    bad, shard, _ = corrupt_copy(packed, key)
    with (
        sdali.loader(bad.path, batch_size=BATCH, shuffle=False) as loader,
        pytest.raises(ChecksumMismatchError) as info,
    ):
        _epoch(loader)
    assert info.value.key == key
    assert info.value.path == shard
    assert info.value.member == "jpeg"


# -- DALI's own tar reader: unverified ---------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2])
def test_unverified_reader_delivers_the_dataset(packed_tar: Packed, world: int) -> None:
    got: collections.Counter[tuple[bytes, int]] = collections.Counter()
    counts = set()
    for rank in range(world):
        loader = _unverified(
            packed_tar.path, batch_size=20, seed=4, shard_id=rank, num_shards=world
        )
        with loader:
            assert not loader.pipeline.verified and loader.pipeline.reader_name
            data, labels, sizes = _epoch(loader)
            assert len(loader) == len(sizes)
        counts.add(len(data))
        got.update(zip(data, labels, strict=True))
    want = collections.Counter(
        (packed_tar.payload[k], packed_tar.label[k]) for k in packed_tar.keys
    )
    assert counts == {len(packed_tar.keys) // world}
    assert got == want


@pytest.mark.parametrize("drop_last", [False, True])
def test_unverified_reader_gives_every_rank_the_same_count(
    packed_tar: Packed, drop_last: bool
) -> None:
    world, batch = 7, 16  # 600 samples: ranks of 85 or 86
    counts = set()
    for rank in range(world):
        with _unverified(
            packed_tar.path, batch_size=batch, shard_id=rank, num_shards=world, drop_last=drop_last
        ) as loader:
            data, labels, sizes = _epoch(loader)
            assert len(loader) == len(sizes)
            assert loader.pipeline.samples_per_rank() == len(data)
        assert all(
            labels[i] == packed_tar.label[_key_of(packed_tar, d)] for i, d in enumerate(data)
        )
        counts.add(len(data))
    assert counts == {80 if drop_last else 96}


def _key_of(packed: Packed, data: bytes) -> str:
    return next(k for k in packed.keys if packed.payload[k] == data)


def test_unverified_hdf5_warns_and_reads_in_shard_dataset_order(packed_hdf5: Packed) -> None:
    with _unverified(packed_hdf5.path, batch_size=BATCH, seed=9) as loader:
        assert not loader.pipeline.verified and loader.pipeline.reader_name is None
        data, labels, _ = _epoch(loader)
    assert (data, labels) == _expected(packed_hdf5, seed=9, epoch=0, ranks=RankInfo())


# -- decoding ------------------------------------------------------------------------------------
@pytest.mark.parametrize("verify", [True, False])
def test_cpu_decode_and_crop_gives_uint8_batches(packed_tar: Packed, verify: bool) -> None:
    kwargs: dict[str, Any] = {"batch_size": 50, "decode": "cpu", "crop": 48, "num_threads": 2}
    if verify:
        loader = sdali.loader(packed_tar.path, **kwargs)
    else:
        loader = _unverified(packed_tar.path, **kwargs)
    with loader:
        batches = 0
        for batch in loader:
            images = batch["data"]
            assert isinstance(images, torch.Tensor)
            assert images.dtype == torch.uint8
            assert images.shape == (50, 48, 48, 3)
            assert batch["label"].shape == (50,)
            batches += 1
        assert batches == len(loader) == 12


def test_cpu_decode_matches_pillow(packed_tar: Packed) -> None:
    with sdali.loader(packed_tar.path, batch_size=8, decode="cpu", shuffle=False) as loader:
        batch = next(iter(loader))
    for i, key in enumerate(packed_tar.keys[:8]):
        want = np.asarray(Image.open(io.BytesIO(packed_tar.payload[key])).convert("RGB"))
        got = batch["data"][i].numpy()
        assert got.shape == want.shape
        diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
        assert diff.mean() < 2.0, f"{key}: mean difference {diff.mean():.2f}"
    assert batch["label"].tolist() == [packed_tar.label[k] for k in packed_tar.keys[:8]]


# -- arguments and imports ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"decode": "mixed"}, "device_id"),
        ({"crop": 224}, "decode"),
        ({"decode": "gpu"}, "invalid decode"),
        ({"shard_id": 1}, "together"),
        ({"shard_id": 2, "num_shards": 2}, "invalid rank"),
        ({"exts": ("png",)}, "no member has extension png"),
        ({"exts": (".jpeg",)}, "invalid extension"),
        ({"batch_size": 0}, "batch_size"),
        ({"order": "backwards"}, "invalid order"),
    ],
)
def test_bad_arguments_raise_usage_error(
    packed_tar: Packed, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(UsageError, match=match):
        sdali.pipeline(packed_tar.path, **{"batch_size": 4, **kwargs})


def test_import_shardio_imports_neither_dali_nor_torch(
    child_env: Callable[..., dict[str, str]],
) -> None:
    script = """
import sys
import shardio
import shardio.dali
from shardio import ShardReader, ShardioError
print("LOADED", sorted({m.split(".")[0] for m in sys.modules} & {"nvidia", "torch"}))
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env=child_env(),
        cwd=os.fspath(Path(__file__).resolve().parents[3]),
    ).stdout
    assert "LOADED []" in out


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, 0),  # one process: local rank 0
        ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "RANK": "3", "WORLD_SIZE": "4"}, 3),
        ({"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8", "RANK": "5", "WORLD_SIZE": "8"}, 1),
        # bind.sh narrowed the rank's view to its one GPU: CUDA's index 0 there
        ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "RANK": "3", "WORLD_SIZE": "4",
          "CUDA_VISIBLE_DEVICES": "3"}, 0),
        ({"CUDA_VISIBLE_DEVICES": ""}, None),  # no GPU visible: a CPU-only pipeline
    ],
)  # fmt: skip
def test_device_id_defaults_to_the_local_ranks_gpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str], expected: int | None
) -> None:
    """Read from sysfs (a fake node with 4 GPUs here), with no CUDA call."""
    from fakesysfs import fake_sysfs

    from shardio.dali._pipeline import DALIOptions

    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    sysfs = fake_sysfs(tmp_path, {0: "0-3", 1: "4-7"}, [0, 0, 1, 1])
    monkeypatch.setenv("SHARDIO_SYSFS", sysfs)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert DALIOptions(batch_size=4).device_id is None  # GPUs, but no NVIDIA driver loaded
    (tmp_path / "module" / "nvidia").mkdir(parents=True)
    assert DALIOptions(batch_size=4).device_id == expected
    assert DALIOptions(batch_size=4, device_id=None).device_id is None  # asked for the CPU
    assert DALIOptions(batch_size=4, device_id=2).device_id == 2


def test_mixed_decoding_with_no_gpu_found_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from fakesysfs import fake_sysfs

    from shardio.dali._pipeline import DALIOptions

    monkeypatch.setenv("SHARDIO_SYSFS", fake_sysfs(tmp_path, {0: "0-3"}, []))
    with pytest.raises(UsageError, match="give device_id"):
        DALIOptions(batch_size=4, decode="mixed")


def test_a_huge_thread_count_is_refused() -> None:
    from shardio.dali._pipeline import DALIOptions

    with pytest.raises(UsageError, match="num_threads must be at most 1024, got 99999"):
        DALIOptions(batch_size=4, device_id=None, num_threads=99_999)


@pytest.mark.parametrize("strategy", [None, "pfs"])
def test_dali_and_the_dataset_set_up_the_same_reader(
    packed_tar: Packed, monkeypatch: pytest.MonkeyPatch, strategy: str | None
) -> None:
    """One reader set-up (shardio.read.setup): the same deadline and strategy for a path."""
    from shardio.dali._source import VerifiedSource
    from shardio.order.spec import OrderSpec

    if strategy is not None:
        monkeypatch.setenv("SHARDIO_READ_STRATEGY", strategy)
    ds = ShardDataset(packed_tar.path, ranks=RankInfo())
    source = VerifiedSource(
        packed_tar.path, batch_size=8, spec=OrderSpec(), ranks=RankInfo(), verify=True,
        stage=None, exts=("jpeg",),
    )  # fmt: skip
    try:
        assert source.read_choice == ds.read_choice
        assert source.read_timeout_s == ds.read_timeout_s
        assert type(source.packed.opener) is type(ds.packed.opener)
    finally:
        source.close()
        ds.close()


# -- the exactly-once audit of the verified path ---------------------------------------------
def test_the_verified_path_audits_each_epoch(
    packed_tar: Packed, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shardio.runtime.audit")
    with sdali.loader(
        packed_tar.path, batch_size=BATCH, seed=7, shard_id=0, num_shards=1
    ) as loader:
        for i, _ in enumerate(loader):  # left early: the next loop reads the rest
            if i == 2:
                break
        for _ in loader:
            pass
        counters = loader.metrics().counters
    lines = [r.getMessage() for r in caplog.records if r.name == "shardio.runtime.audit"]
    assert lines == [f"epoch 0: {len(packed_tar.keys)} samples, each exactly once"], lines
    assert counters["epochs_audited"] == 1 and counters["epochs_not_exact"] == 0


def test_dali_s_own_reader_is_not_audited(packed_tar: Packed) -> None:
    loader = _unverified(packed_tar.path, batch_size=BATCH, shard_id=0, num_shards=1)
    try:
        for _ in loader:
            pass
        assert "epochs_audited" not in loader.metrics().counters
    finally:
        loader.close()
