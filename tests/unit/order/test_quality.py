"""Shuffle quality: the figures on orders with known answers, the accumulator against the
spec path on the orders ranks really read, the sampling of a billion-sample epoch, and the
checks of every argument."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shardio.errors import UsageError
from shardio.order import OrderSpec, RankInfo, rank_stream
from shardio.order.quality import compare_orders, order_quality
from shardio.order.quality_report import QualityAccumulator, dataset_label_entropy

CLASSES = 4
SIZES = np.full(8, 64, dtype=np.int64)  # 512 samples, 8 shards of 64
N = int(SIZES.sum())
SORTED_LABELS = np.repeat(np.arange(CLASSES), N // CLASSES)  # packed by class directory
SHARD_OF = np.repeat(np.arange(len(SIZES)), SIZES)


def _measure(order: np.ndarray, labels: np.ndarray, batch: int, **kw: object) -> object:
    """Feed ``order`` cut into batches to an accumulator, as a loader delivers it."""
    acc = QualityAccumulator(dataset_entropy=dataset_label_entropy(labels), **kw)  # type: ignore[arg-type]
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        acc.observe(2, idx, labels[idx], SHARD_OF[idx])
    return acc.end_epoch(2)


def test_sequential_reads_one_shard_per_batch_in_storage_order() -> None:
    r = order_quality(SIZES, SORTED_LABELS, OrderSpec(order="sequential"), batch_size=16)
    assert r.rho == pytest.approx(1.0)
    assert (r.shards_per_batch, r.shards_per_batch_min) == (1.0, 1)
    assert r.shards_per_window == 2.0  # 8 batches of 16 = two shards of 64
    assert r.switches_per_batch == pytest.approx(7 / 32)  # 7 shard ends in 32 batches
    assert r.label_entropy == r.label_entropy_p5 == 0.0  # class-sorted: one class per batch
    assert (r.batches, r.batches_measured, r.sampled) == (32, 32, False)
    assert r.memory_bytes is not None and r.memory_bytes < 200  # O(shards), not 8 B a sample


def test_a_class_interleaved_order_is_exactly_as_mixed_as_the_dataset() -> None:
    interleaved = np.arange(N).reshape(CLASSES, -1).T.ravel()  # 0, 128, 256, 384, 1, ...
    r = _measure(interleaved, SORTED_LABELS, 16)
    assert r.label_entropy == pytest.approx(1.0)
    assert r.label_entropy_p5 == pytest.approx(1.0)
    assert r.entropy_ceiling == 1.0
    assert r.shards_per_batch == 4.0  # each class lies in 2 shards: 4 shards per batch
    # The same labels laid out interleaved, read sequentially: the spec path agrees.
    cyclic = np.arange(N) % CLASSES
    s = order_quality(SIZES, cyclic, OrderSpec(order="sequential"), batch_size=16)
    assert s.label_entropy == pytest.approx(1.0) and s.rho == pytest.approx(1.0)


def test_the_line_and_the_ceiling_of_a_small_batch() -> None:
    labels = np.arange(N) % 64  # 64 classes: a batch of 16 holds at most log 16 / log 64
    r = order_quality(SIZES, labels, OrderSpec(seed=1), batch_size=16, epoch=3)
    assert r.entropy_ceiling == pytest.approx(math.log(16) / math.log(64))
    line = r.line()
    assert line.startswith("epoch 3 shuffle: label entropy 0.")
    assert "a batch of 16 holds at most 0.67" in line and "rho=" in line
    assert "distinct shards per batch" in line
    assert r.to_dict()["order"] == str(OrderSpec(seed=1))


@pytest.mark.parametrize(
    ("text", "nodes"),
    [
        ("random", 1),
        ("order=shard-local,window=2", 1),
        ("sequential", 1),
        ("order=random,partition=node", 3),
        ("order=shard-local,partition=rotating,rotate=0.5", 3),
        ("order=random,partition=node,drop_last=1", 3),
    ],
)
def test_the_accumulator_equals_the_spec_path_on_the_delivered_order(text: str, nodes: int) -> None:
    """What ranks really read (rank_stream, one rank per node), batch by batch."""
    sizes = np.array([64, 64, 50, 64, 30, 64, 64, 61, 20, 64], dtype=np.int64)
    n = int(sizes.sum())
    labels = np.random.default_rng(0).integers(0, 7, n)
    labels[::9] = -1  # some samples without a label
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    spec = OrderSpec.parse(text)
    acc = QualityAccumulator(dataset_entropy=dataset_label_entropy(labels))
    for node in range(nodes):
        layout = RankInfo(rank=node, world_size=nodes, ranks_per_node=1)
        delivered = rank_stream(sizes, spec, 5, layout).materialise()
        for start in range(0, len(delivered), 24):
            idx = delivered[start : start + 24]
            acc.observe(5, idx, labels[idx], shard_of[idx], position=start)
    mine = acc.end_epoch(5)
    theirs = order_quality(sizes, labels, spec, epoch=5, batch_size=24, nodes=nodes)
    assert not theirs.sampled
    for field in ("batches", "samples_measured", "shards_per_batch_min", "batch_size"):
        assert getattr(mine, field) == getattr(theirs, field), field
    for field in (
        "label_entropy",
        "label_entropy_p5",
        "shards_per_batch",
        "shards_per_window",
        "switches_per_batch",
        "rho",
    ):
        assert getattr(mine, field) == pytest.approx(getattr(theirs, field), abs=1e-12), field


def test_an_epoch_change_starts_afresh_and_an_empty_epoch_says_so() -> None:
    acc = QualityAccumulator(dataset_entropy=None)
    acc.observe(0, np.arange(4), None, np.zeros(4, np.int64))
    acc.observe(1, np.arange(4, 8), None, np.ones(4, np.int64))  # epoch 0 left unreported
    r = acc.end_epoch(1)
    assert (r.batches, r.label_entropy, r.shards_per_batch) == (1, None, 1.0)
    assert "no labels" in r.line()
    assert acc.end_epoch(1).line() == "epoch 1 shuffle: no batches"


def test_a_billion_samples_are_sampled_to_2000_batches() -> None:
    class Labels:  # an index's label column, without the 4 GB
        def __len__(self) -> int:
            return 10**9

        def __getitem__(self, i: np.ndarray) -> np.ndarray:
            return np.asarray(i) // 1000 % 1000

    sizes = np.full(100_000, 10_000)
    r = order_quality(sizes, Labels(), OrderSpec(seed=7), batch_size=256)
    assert r.sampled and r.batches == 3_906_250 and 1_900 <= r.batches_measured <= 2_000
    assert abs(r.rho or 1.0) < 0.01
    assert r.shards_per_batch > 250  # 256 samples from 100,000 shards
    assert r.label_entropy is not None and r.entropy_ceiling is not None
    assert r.label_entropy == pytest.approx(r.entropy_ceiling, abs=0.03)


def test_compare_orders_ranks_them_as_the_docs_say() -> None:
    found = dict(compare_orders(SIZES, SORTED_LABELS, batch_size=16, nodes=2))
    rnd, local, seq = found["random"], found["shard-local, window 4"], found["sequential"]
    part = found["partition=node"]
    assert rnd.label_entropy > local.label_entropy > seq.label_entropy  # type: ignore[operator]
    assert rnd.switches_per_batch > local.switches_per_batch > seq.switches_per_batch
    assert abs(rnd.rho) < 0.2 and seq.rho == pytest.approx(1.0)  # type: ignore[arg-type]
    assert part.shards_per_window <= 4  # a node reads only its own 4 shards


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch size must be"),
        ({"batch_size": -1}, "batch size must be"),
        ({"batch_size": 1 << 21}, "batch size must be"),
        ({"batch_size": 513}, "larger than the dataset's 512 samples"),
        ({"batch_size": 16, "epoch": -1}, "epoch must be"),
        ({"batch_size": 16, "nodes": 0}, "nodes must be"),
        ({"batch_size": 16, "nodes": 9, "spec": "order=random,partition=node"}, "8 shards"),
        ({"batch_size": True}, "batch size"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs: dict[str, object], message: str) -> None:
    spec = OrderSpec.parse(str(kwargs.pop("spec", "random")))
    with pytest.raises(UsageError, match=message) as info:
        order_quality(SIZES, SORTED_LABELS, spec, **kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_observe_refuses_arrays_that_do_not_match() -> None:
    acc = QualityAccumulator(dataset_entropy=1.0)
    with pytest.raises(UsageError, match="labels must be 4 integers"):
        acc.observe(0, np.arange(4), np.arange(3), np.zeros(4, np.int64))
    with pytest.raises(UsageError, match="shards must be >= 0"):
        acc.observe(0, np.arange(4), None, np.full(4, -2))
    with pytest.raises(UsageError, match="dataset_entropy"):
        QualityAccumulator(dataset_entropy=float("nan"))
    with pytest.raises(UsageError, match="window_batches"):
        QualityAccumulator(dataset_entropy=None, window_batches=0)
