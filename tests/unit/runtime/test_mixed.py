"""MixedDataset: a weighted, deterministic mix of packed datasets; equal counts per rank,
exact and elastic resume, provenance of each sample and the mix drawn in the metrics."""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tracemalloc
import types

import numpy as np
import pytest
import torch
from resuming import assert_resumed_exactly, resumed, saved, take
from trees import write_tree

from shardio.errors import UsageError
from shardio.metrics.snapshots import MetricsSnapshot
from shardio.order import RankInfo
from shardio.order.cursor import EpochCursor
from shardio.order.spec import OrderSpec
from shardio.packing.run import PackOptions, pack
from shardio.runtime.batch import ByteColumn
from shardio.runtime.dataset import ShardDataset
from shardio.runtime.loader import ShardLoader
from shardio.runtime.mixed import MixedDataset, mix_counts, mix_schedule
from shardio.runtime.protocol import ReadSource

BATCH = 16
WEIGHTS = (0.7, 0.3)


def _make_source(root: pathlib.Path, prefix: str, files: int, fmt: str) -> dict[str, bytes]:
    """Pack ``files`` small files (keys ``cK/<prefix>_NNNN``) into ``root/ds``; return
    key -> bytes."""
    rng = random.Random(prefix)
    tree = {
        f"c{i % 3}/{prefix}_{i:04d}.jpg".encode(): rng.randbytes(300 + rng.randrange(900))
        for i in range(files)
    }
    write_tree(root / "src", tree)
    pack(
        os.fspath(root / "src"),
        os.fspath(root / "ds"),
        PackOptions(shard_format=fmt, shard_size_bytes=32 * 1024, durable=False),
    )
    return {os.fsdecode(k).rsplit(".", 1)[0]: v for k, v in tree.items()}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[pathlib.Path, ...], dict]:
    """Two packed datasets of distinct keys (200 samples in tar, 300 in hdf5), and the bytes
    of every key."""
    root = tmp_path_factory.mktemp("mixed")
    payload = _make_source(root / "a", "a", 200, "tar")
    payload |= _make_source(root / "b", "b", 300, "hdf5")
    return (root / "a" / "ds", root / "b" / "ds"), payload


@pytest.fixture
def sources(built) -> tuple[pathlib.Path, ...]:
    return built[0]


@pytest.fixture
def payload(built) -> dict[str, bytes]:
    return built[1]


def mixed(paths, *, seed=0, ranks=None, weights=WEIGHTS, modes=("map", "stream"), **kw):
    datasets = [
        ShardDataset(p, mode=m, seed=10 + i, ranks=ranks)
        for i, (p, m) in enumerate(zip(paths, modes, strict=True))
    ]
    return MixedDataset(list(zip(datasets, weights, strict=True)), seed=seed, **kw)


def drawn(mix: MixedDataset) -> list[tuple[int, str]]:
    """(source, key) of every position of the mix's epoch, in order."""
    return [(s["__source__"], s["__key__"]) for s in (mix[p] for p in range(len(mix)))]


def keys(loader) -> list[str]:
    return [k for b in loader for k in b["__key__"]]


# ------------------------------------------------------------------ the epoch


def test_epoch_ends_when_the_first_source_runs_out_at_its_weight(sources):
    mix = mixed(sources)
    # 200 / 0.7 = 285.7: source 0 is the first to run out; all its samples are drawn once.
    assert mix.counts == (200, 86)
    assert len(mix) == mix.num_samples == 286
    assert mix_counts([200, 300], WEIGHTS) == [200, 86]
    assert max(c - n for c, n in zip(_apportion_next(mix), (200, 300), strict=True)) > 0
    got = drawn(mix)
    per_source = collections.defaultdict(list)
    for s, key in got:
        per_source[s].append(key)
    for s, ds in enumerate(mix.sources):
        order = ds.epoch_order()
        prefix = [ds.packed.key(int(i)) for i in order[: mix.counts[s]]]
        assert per_source[s] == prefix  # the first draws of the source's own epoch order
        assert len(set(per_source[s])) == mix.counts[s]


def _apportion_next(mix: MixedDataset) -> list[int]:
    """The draws of a mix one longer than the epoch (one source must overflow)."""
    from shardio.order.mix import apportion as _apportion

    return _apportion(mix.num_samples + 1, list(mix.weights))


def test_the_mix_is_a_pure_function_of_seed_and_epoch(sources):
    first, again = mixed(sources, seed=5), mixed(sources, seed=5)
    assert drawn(first) == drawn(again)
    other_seed = mixed(sources, seed=6)
    assert drawn(other_seed) != drawn(first)
    assert sorted(drawn(other_seed)) == sorted(drawn(first))  # the same draws, mixed otherwise
    first.set_epoch(3)
    assert all(ds.epoch == 3 for ds in first.sources)  # propagated
    epoch3 = drawn(first)
    assert epoch3 != drawn(again)
    again.set_epoch(3)
    assert drawn(again) == epoch3
    first.sources[0].set_epoch(9)  # set on its own: the mix's next iteration brings it back
    assert keys(first.loader(BATCH)) == [k for _, k in epoch3]
    assert first.sources[0].epoch == 3
    # The source's own epoch order changes with the epoch, and the mix takes from it.
    assert {k for _, k in epoch3} != {k for _, k in drawn(mixed(sources, seed=5))}


def test_realised_proportions_hold_over_any_window(sources):
    source, draw = mix_schedule([200, 86], seed=0, epoch=0)
    shares = np.array([200, 86]) / 286
    ones = (source == 1).astype(np.int64)
    prefix = np.concatenate([[0], np.cumsum(ones)])
    for width in (10, 37, 100, 286):
        got = prefix[width:] - prefix[:-width]
        assert np.abs(got - width * shares[1]).max() <= 2, width
    # Each source's draws come in its own order, each once.
    for s, count in enumerate((200, 86)):
        assert draw[source == s].tolist() == list(range(count))
    # Through the dataset: the __source__ of what the loader delivers.
    delivered = [int(s) for b in mixed(sources).loader(BATCH) for s in b["__source__"].tolist()]
    assert collections.Counter(delivered) == {0: 200, 1: 86}
    first_50 = collections.Counter(delivered[:50])
    assert abs(first_50[0] - 50 * 200 / 286) <= 2


def test_weights_are_normalised(sources):
    assert mixed(sources, weights=(7, 3)).counts == mixed(sources).counts
    assert mixed(sources, weights=(7, 3)).weights == pytest.approx(WEIGHTS)


# ------------------------------------------------------------------ samples


@pytest.mark.parametrize("workers", [0, 2])
def test_samples_carry_their_source_and_their_bytes(sources, payload, workers):
    seen = 0
    for batch in mixed(sources).loader(BATCH, workers):
        assert set(batch) == {"__key__", "jpg", "cls", "__source__"}
        assert batch["__source__"].dtype == torch.int64
        assert batch["cls"].dtype == torch.int64
        for key, s, data in zip(
            batch["__key__"], batch["__source__"].tolist(), batch["jpg"], strict=True
        ):
            assert key.split("/")[1].startswith("ab"[s])  # the source's own keys
            assert data == payload[key], key
            seen += 1
    assert seen == 286


def test_a_resilient_source_reads_through_its_policy(sources):
    recovering = ShardDataset(sources[1], seed=11, recovery="skip")
    mix = MixedDataset([(ShardDataset(sources[0], seed=10), 1.0), (recovering, 1.0)])
    assert mix.sources[1].recovery_policy is not None
    got = keys(mix.loader(BATCH))
    assert len(got) == len(set(got)) == 400  # 200 + 200: each source at one half


# ------------------------------------------------------------------ ranks


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_same_count_and_the_ranks_cover_the_mix(sources, world):
    whole = keys(mixed(sources).loader(BATCH))
    per_rank = [
        keys(mixed(sources, ranks=RankInfo(rank=r, world_size=world)).loader(BATCH, 0))
        for r in range(world)
    ]
    assert len({len(k) for k in per_rank}) == 1
    assert len(per_rank[0]) == math.ceil(286 / world)
    assert set(itertools.chain(*per_rank)) == set(whole)
    # Ranks take interleaved positions of the one global mix.
    assert per_rank[1][:5] == whole[1 : 5 * world : world]
    cut = [
        len(keys(mixed(sources, ranks=RankInfo(rank=r, world_size=3), drop_last=True).loader(8)))
        for r in range(3)
    ]
    assert cut == [286 // 3] * 3


_GLOO_RANK = """
import json, sys
from datetime import timedelta
import torch, torch.distributed as dist
from shardio import MixedDataset, ShardDataset
a, b, out, rank = sys.argv[1:5]
# A file rendezvous: no port picked here that another process could take first.
dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=int(rank),
                        world_size=2, timeout=timedelta(seconds=60))
mix = MixedDataset([(ShardDataset(a, seed=10), 0.7),
                    (ShardDataset(b, mode="stream", seed=11), 0.3)], seed=0)
keys = [k for batch in mix.loader(16, 1) for k in batch["__key__"]]
low, high = torch.tensor([len(keys)]), torch.tensor([len(keys)])
dist.all_reduce(low, op=dist.ReduceOp.MIN)
dist.all_reduce(high, op=dist.ReduceOp.MAX)
with open(f"{out}/rank-{rank}.json", "w") as fh:
    json.dump({"keys": keys, "min": int(low), "max": int(high),
               "world": mix.ranks().world_size, "source": mix.ranks().source}, fh)
"""


def test_a_real_two_rank_gloo_job_reads_equal_shares_of_the_mix(sources, tmp_path, child_env):
    args = [sys.executable, "-c", _GLOO_RANK, *map(str, sources), str(tmp_path)]
    procs = [
        subprocess.Popen(
            [*args, str(r)],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for r, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {r} failed:\n{out}"
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    whole = keys(mixed(sources).loader(BATCH))
    for r, got in enumerate(results):
        assert (got["world"], got["source"]) == (2, "torch.distributed")
        assert got["min"] == got["max"] == len(got["keys"]) == 143
        assert got["keys"] == whole[r::2]


def test_a_plain_dataloader_reads_the_rank_share(sources):
    mix = mixed(sources, ranks=RankInfo(rank=1, world_size=2))
    reference = keys(mixed(sources, ranks=RankInfo(rank=1, world_size=2)).loader(BATCH))
    plain = torch.utils.data.DataLoader(
        mix, batch_size=BATCH, sampler=mix.rank_indices(), num_workers=1, collate_fn=lambda b: b
    )
    batches = list(plain)
    assert all(set(b) == {"__key__", "jpg", "cls", "__source__"} for b in batches)
    assert [k for b in batches for k in b["__key__"]] == reference
    assert len(mix.loader(BATCH)) == len(batches) == math.ceil(143 / BATCH)


def test_sources_with_different_rank_layouts_are_refused(sources):
    a = ShardDataset(sources[0], ranks=RankInfo(rank=0, world_size=2))
    b = ShardDataset(sources[1], ranks=RankInfo(rank=1, world_size=2))
    with pytest.raises(UsageError, match="share one rank layout: source 0 is rank 0 of 2"):
        MixedDataset([(a, 1), (b, 1)])


# ------------------------------------------------------------------ resume


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_equals_the_uninterrupted_epoch(sources, workers):
    whole = keys(mixed(sources, seed=3).loader(BATCH, workers))
    loader = mixed(sources, seed=3).loader(BATCH, workers)
    head = take(loader, 5)
    state = saved(loader.state_dict())
    assert state["cursor"]["consumed"] == 5 * BATCH
    again = resumed(lambda: mixed(sources, seed=3).loader(BATCH, workers), state)
    assert_resumed_exactly(head, keys(again), whole)


def test_resume_in_a_later_epoch_and_by_direct_iteration(sources):
    ref = mixed(sources, seed=3)
    ref.set_epoch(2)
    whole = [s["__key__"] for s in ref]
    mix = mixed(sources, seed=3)
    mix.set_epoch(2)
    head = [s["__key__"] for s in itertools.islice(iter(mix), 41)]
    state = saved(mix.state_dict())
    fresh = resumed(lambda: mixed(sources, seed=3), state)
    assert fresh.epoch == 2 and all(ds.epoch == 2 for ds in fresh.sources)
    assert_resumed_exactly(head, [s["__key__"] for s in fresh], whole)


def test_elastic_resume_from_two_ranks_to_one_reads_exactly_the_rest(sources):
    whole = keys(mixed(sources, seed=4).loader(BATCH))
    heads, states = [], []
    for r in range(2):
        loader = mixed(sources, seed=4, ranks=RankInfo(rank=r, world_size=2)).loader(BATCH)
        heads.append(take(loader, 3))
        states.append(saved(loader.state_dict()))
    assert states[0] == states[1]
    assert states[0]["cursor"]["consumed"] == 2 * 3 * BATCH
    tail = keys(resumed(lambda: mixed(sources, seed=4).loader(BATCH, 2), states[0]))
    assert tail == whole[2 * 3 * BATCH :]
    got = collections.Counter(heads[0] + heads[1] + tail)
    assert got == collections.Counter(whole)  # every sample of the mix once


def test_state_of_another_mix_is_refused(sources):
    state = saved(mixed(sources).state_dict())
    ident = mixed(sources).loader(BATCH).dataset_id  # what shardio.checkpoint records
    assert isinstance(ident, str) and len(ident) == 32
    assert mixed(sources).loader(BATCH).dataset_id == ident
    assert mixed(sources, weights=(0.5, 0.5)).loader(BATCH).dataset_id != ident
    with pytest.raises(UsageError, match="source 0 differs in weight: cannot resume"):
        mixed(sources, weights=(0.5, 0.5)).load_state_dict(state)
    with pytest.raises(UsageError, match="another order"):
        mixed(sources, seed=1).load_state_dict(state)
    with pytest.raises(UsageError, match="not the state of a MixedDataset"):
        mixed(sources).load_state_dict(state["cursor"])
    swapped = MixedDataset(
        [(ShardDataset(sources[1], seed=11), 0.3), (ShardDataset(sources[0], seed=10), 0.7)]
    )
    with pytest.raises(UsageError, match="source 0 differs in"):
        swapped.load_state_dict(state)


# ------------------------------------------------------------------ metrics


def test_metrics_report_the_mix_drawn(sources):
    loader = mixed(sources, names=("web", "books")).loader(BATCH, 2)
    head = take(loader, 4)
    snap = loader.metrics()
    assert sum(snap.sources.values()) == len(head) == 4 * BATCH
    drawn_head = collections.Counter(
        "web" if k.split("/")[1].startswith("a") else "books" for k in head
    )
    assert snap.sources == dict(drawn_head)
    rest = keys(loader)
    snap = loader.metrics()
    assert snap.sources == {"web": 200, "books": 86}
    assert snap.samples == len(head) + len(rest) == 286
    assert snap.samples_read == 286  # the workers' reads, sent with their delivered batches
    back = MetricsSnapshot.from_dict(json.loads(json.dumps(snap.to_dict())))
    assert back.sources == {"web": 200, "books": 86}


def test_the_exporter_serves_the_mix_drawn(sources, tmp_path):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from shardio.metrics import PrometheusExporter

    loader = mixed(sources, names=("web", "books")).loader(BATCH, 0)
    keys(loader)
    textfile = tmp_path / "shardio.prom"
    with PrometheusExporter(loader.metrics, port=None, textfile=str(textfile), job="j") as exp:
        assert exp.report()
    served = {
        s.labels["dataset"]: s.value
        for family in text_string_to_metric_families(textfile.read_text())
        for s in family.samples
        if s.name == "shardio_mix_samples_delivered_total"
    }
    assert served == {"web": 200, "books": 86}


# ------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (0, "must be positive and finite, got 0"),
        (-0.5, "must be positive and finite, got -0.5"),
        (math.nan, "must be positive and finite, got nan"),
        (math.inf, "must be positive and finite, got inf"),
        (True, "must be a number, not a bool"),
        (np.bool_(True), "must be a number, not a bool"),
        ("0.5", "must be a number, got str"),
        (None, "must be a number, got NoneType"),
    ],
)
def test_bad_weights_are_refused(sources, weight, message):
    a, b = ShardDataset(sources[0]), ShardDataset(sources[1])
    with pytest.raises(UsageError, match=f"^weight of source 1 {message}"):
        MixedDataset([(a, 1.0), (b, weight)])


@pytest.mark.parametrize(
    "weights",
    [
        (1e308, 1e308),  # their sum is inf: scaled before it is taken
        (1e-320, 1.0),  # a subnormal weight: n / w is inf, which has no floor
        (1e-12, 1.0),
    ],
)
def test_extreme_weights_mix_or_are_refused_in_one_line(sources, weights):
    a, b = ShardDataset(sources[0]), ShardDataset(sources[1])
    mix = MixedDataset([(a, weights[0]), (b, weights[1])])
    assert math.isclose(sum(mix.weights), 1.0) and min(mix.weights) > 0
    assert all(c <= ds.num_samples for c, ds in zip(mix.counts, (a, b), strict=True))
    assert sum(mix.counts) > 0
    with pytest.raises(UsageError, match="span too many orders of magnitude"):
        MixedDataset([(a, 1e-300), (b, 1e300)])


def test_bad_sources_are_refused(sources):
    a = ShardDataset(sources[0])
    with pytest.raises(UsageError, match="at least one"):
        MixedDataset([])
    with pytest.raises(UsageError, match="source 1 of the mix must be a ShardDataset"):
        MixedDataset([(a, 1.0), ("data/", 1.0)])
    with pytest.raises(UsageError, match="source 1 of the mix is the same dataset as source 0"):
        MixedDataset([(a, 1.0), (a, 2.0)])
    with pytest.raises(UsageError, match=r"source 0 of the mix must be a \(dataset, weight\) pair"):
        MixedDataset([a])
    with pytest.raises(UsageError, match="sources must be a list"):
        MixedDataset(a)  # type: ignore[arg-type]
    node = ShardDataset(sources[1], order="order=random,partition=node")
    with pytest.raises(UsageError, match="partition='node': a mix needs"):
        MixedDataset([(a, 1.0), (node, 1.0)])
    with pytest.raises(UsageError, match="seed must be at least 0"):
        MixedDataset([(a, 1.0)], seed=-1)
    with pytest.raises(UsageError, match="names must be a list of 1 strings"):
        MixedDataset([(a, 1.0)], names=3)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="names must be distinct"):
        MixedDataset([(a, 1.0), (ShardDataset(sources[1]), 1.0)], names=("x", "x"))


# ------------------------------------------------------------------ label maps


def _pack_labelled(root: pathlib.Path, classes: tuple[str, ...], files: int, **opts) -> str:
    """Pack ``files`` small files spread over the class directories ``classes`` (keys
    ``<class>/<root name>_NN``); with ``labels="none"`` in ``opts``, unlabelled."""
    rng = random.Random(root.name)
    tree = {
        f"{classes[i % len(classes)]}/{root.name}_{i:02d}.jpg".encode(): rng.randbytes(200)
        for i in range(files)
    }
    write_tree(root / "src", tree)
    pack(
        os.fspath(root / "src"),
        os.fspath(root / "ds"),
        PackOptions(shard_format="tar", durable=False, **opts),
    )
    return os.fspath(root / "ds")


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Three small datasets: "pets" (cat, dog), "roads" (cat, truck), "plain" (no labels)."""
    root = tmp_path_factory.mktemp("labels")
    return {
        "pets": _pack_labelled(root / "pets", ("cat", "dog"), 12),
        "roads": _pack_labelled(root / "roads", ("cat", "truck"), 12),
        "plain": _pack_labelled(root / "plain", ("x",), 12, labels="none"),
    }


def test_sources_with_different_label_maps_are_refused_in_one_line(labelled):
    pets, roads = ShardDataset(labelled["pets"]), ShardDataset(labelled["roads"])
    assert pets.classes == ("cat", "dog") and roads.classes == ("cat", "truck")
    with pytest.raises(UsageError) as info:
        MixedDataset([(pets, 1.0), (roads, 1.0)])
    message = str(info.value)
    assert "\n" not in message
    assert f"sources 0 ({labelled['pets']}) and 1 ({labelled['roads']})" in message
    assert "['cat', 'dog'] (2 classes) and ['cat', 'truck'] (2 classes)" in message
    assert "class 1 is 'dog' in one, 'truck' in the other" in message
    assert "classes=" in message


def test_identical_or_missing_label_maps_mix_as_before(labelled, tmp_path):
    again = _pack_labelled(tmp_path / "more_pets", ("cat", "dog"), 6)
    mix = MixedDataset([(ShardDataset(labelled["pets"]), 1), (ShardDataset(again), 1)])
    assert mix.classes == ("cat", "dog")
    for batch in mix.loader(4):
        for key, label in zip(batch["__key__"], batch["cls"].tolist(), strict=True):
            assert mix.classes[label] == key.split("/")[0]  # labels as packed
    # A source without labels mixes with any map (its samples have no cls).
    plain = MixedDataset(
        [(ShardDataset(labelled["plain"]), 1), (ShardDataset(labelled["roads"]), 1)]
    )
    assert plain.classes == ("cat", "truck")
    got = [s for b in plain.loader(4) for s in zip(b["__source__"].tolist(), b["cls"], strict=True)]
    assert {label is None for s, label in got if s == 0} == {True}
    assert {plain.classes[label] for s, label in got if s == 1} == {"cat", "truck"}


@pytest.mark.parametrize("workers", [0, 2])
def test_classes_remaps_every_source_into_the_mix_map(labelled, workers):
    classes = ("truck", "dog", "cat")  # neither source's order
    mix = MixedDataset(
        [(ShardDataset(labelled["pets"]), 1.0), (ShardDataset(labelled["roads"]), 1.0)],
        classes=list(classes),
    )
    assert mix.classes == classes
    seen = collections.Counter()
    for batch in mix.loader(5, workers):
        assert batch["cls"].dtype == torch.int64
        for key, label in zip(batch["__key__"], batch["cls"].tolist(), strict=True):
            assert classes[label] == key.split("/")[0], key  # the class the sample was packed as
            seen[classes[label]] += 1
    assert set(seen) == {"truck", "dog", "cat"} and sum(seen.values()) == 24
    # Direct iteration and indexing remap alike.
    assert all(classes[s["cls"]] == s["__key__"].split("/")[0] for s in mix)
    assert all(classes[mix[p]["cls"]] == mix[p]["__key__"].split("/")[0] for p in range(24))


def test_classes_leaves_unlabelled_sources_alone(labelled):
    mix = MixedDataset(
        [(ShardDataset(labelled["plain"]), 1.0), (ShardDataset(labelled["roads"]), 1.0)],
        classes=("truck", "cat", "bus"),
    )
    got = [(s["__source__"], s.get("cls"), s["__key__"]) for s in mix]
    assert {label for s, label, _ in got if s == 0} == {None}
    assert all(mix.classes[label] == key.split("/")[0] for s, label, key in got if s == 1)


@pytest.mark.parametrize(
    ("classes", "message"),
    [
        ("cat", "classes must be a list of class names, got str"),
        ([], "classes must name at least one class, got none"),
        (["cat", "dog", "cat", "truck"], "classes holds 'cat' twice"),
        (["cat", "", "dog"], r"classes\[1\] must be a non-empty string, got ''"),
        (["cat", 3], r"classes\[1\] must be a non-empty string, got 3"),
        (["cat", "dog"], r"source 1 of the mix \(.*roads.*\) has classes that classes= lacks: "),
    ],
)
def test_bad_classes_are_refused(labelled, classes, message):
    pets, roads = ShardDataset(labelled["pets"]), ShardDataset(labelled["roads"])
    with pytest.raises(UsageError, match=message):
        MixedDataset([(pets, 1.0), (roads, 1.0)], classes=classes)


def test_classes_without_any_labelled_source_is_refused(labelled, tmp_path):
    other = _pack_labelled(tmp_path / "plain2", ("x",), 4, labels="none")
    with pytest.raises(UsageError, match="no source of the mix has any"):
        MixedDataset(
            [(ShardDataset(labelled["plain"]), 1), (ShardDataset(other), 1)], classes=["a"]
        )


def test_a_transform_that_changes_the_label_type_is_refused_when_remapping(labelled):
    def stringly(sample):
        return {**sample, "cls": str(sample["cls"])}

    mix = MixedDataset(
        [(ShardDataset(labelled["pets"], transform=stringly), 1.0)], classes=["dog", "cat"]
    )
    with pytest.raises(UsageError, match=r"has a 'cls' of type str: classes= remaps integer"):
        mix[0]


# ------------------------------------------------------------------ one dataset, once


def test_one_dataset_given_twice_is_refused_however_it_was_opened(sources, tmp_path):
    from shardio.staging.stage import StageOptions, stage_dataset

    path = sources[0]
    ds = ShardDataset(path, seed=1)
    link = tmp_path / "link"
    link.symlink_to(path, target_is_directory=True)
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)  # byte for byte: the same dataset id
    area = tmp_path / "area"
    stage_dataset(os.fspath(path), os.fspath(area), StageOptions())
    with pytest.warns(DeprecationWarning):  # the older spelling: still the same dataset
        recovering = ds.with_recovery("skip")
    twins = {
        "object": ds,
        "path": ShardDataset(path, seed=2),
        "recovering": recovering,
        "resilient": ShardDataset(path, recovery="skip"),
        "stream": ShardDataset(os.fspath(path) + "/", mode="stream"),
        "symlink": ShardDataset(link),
        "copy": ShardDataset(copy),
        "area": ShardDataset(area),
        "cached": ShardDataset(path, stage=area),
    }
    for how, twin in twins.items():
        with pytest.raises(UsageError) as info:
            MixedDataset([(ds, 0.5), (ShardDataset(sources[1]), 1.0), (twin, 0.5)])
        message = str(info.value)
        assert "source 2 of the mix is the same dataset as source 0" in message, how
        assert "drawn twice an epoch" in message and "\n" not in message, how
    # Distinct datasets still mix, whatever their objects.
    assert len(MixedDataset([(ds, 1), (ShardDataset(sources[1]), 1)])) == 400


# ------------------------------------------------------------------ start-up cost


class _HugeSource(ShardDataset):
    """A source of 10^10 samples (10^5 shards) with no data anywhere: sample i is its key."""

    def __init__(self, name: str) -> None:  # no manifest to open: nothing of ShardDataset's
        self.name = name
        self.path = f"/nowhere/{name}"
        self.spec = OrderSpec(order="random", seed=len(name))
        self.cursor = EpochCursor(self.spec, np.full(100_000, 100_000), ranks=RankInfo())
        self.num_samples = 10**10
        self.read_timeout_s = 0.0
        ident = types.SimpleNamespace(dataset_id=name * 8, describe=lambda: name)
        self._fake = types.SimpleNamespace(
            resolver=types.SimpleNamespace(
                identity=lambda: ident, source_root=self.path, dataset_id=name * 8
            )
        )

    @property
    def packed(self):
        return self._fake

    @property
    def classes(self):
        return None

    def __getitem__(self, index):
        return {"__key__": f"{self.name}/{index}"}


def test_a_mix_of_two_huge_sources_starts_without_their_size(tmp_path):
    """Start-up does not grow with the sources: no array or list of the epoch is built (a
    mix of 2 x 10^10 would need hundreds of GB), and resume works as before."""
    tracemalloc.start()
    try:
        mix = MixedDataset([(_HugeSource("aaaa"), 0.5), (_HugeSource("bbbb"), 0.5)], seed=3)
        loader = mix.loader(64)
        batches = iter(loader)
        first = next(batches)
        state = loader.state_dict()
        second = next(batches)
        last = mix[len(mix) - 1]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak
    assert len(mix) == 2 * 10**10 and last["__key__"].startswith(("aaaa/", "bbbb/"))
    # Each source gives the first samples of its own epoch order, in order.
    for s, ds in enumerate(mix.sources):
        mine = [
            k
            for k, src in zip(first["__key__"], first["__source__"].tolist(), strict=True)
            if src == s
        ]
        expected = ds.cursor.stream(consumed=0).take(0, len(mine)).tolist()
        assert mine == [f"{ds.name}/{i}" for i in expected]
        assert abs(len(mine) - 32) <= 2
    again = MixedDataset([(_HugeSource("aaaa"), 0.5), (_HugeSource("bbbb"), 0.5)], seed=3)
    resumed_loader = again.loader(64)
    resumed_loader.load_state_dict(json.loads(json.dumps(state)))
    assert next(iter(resumed_loader))["__key__"] == second["__key__"]


def test_a_state_resumes_only_a_mix_whose_labels_mean_the_same_classes(labelled):
    def mix(classes):
        datasets = [ShardDataset(labelled["pets"]), ShardDataset(labelled["roads"])]
        return MixedDataset([(d, 1.0) for d in datasets], classes=classes)

    loader = mix(["cat", "dog", "truck"]).loader(4)
    head = take(loader, 2)
    state = saved(loader.state_dict())
    assert state["classes"] == ["cat", "dog", "truck"]
    with pytest.raises(UsageError, match=r"labels mean other classes \(label map \['cat', 'dog'"):
        mix(["truck", "dog", "cat"]).load_state_dict(state)
    assert mix(["truck", "dog", "cat"]).loader(4).dataset_id != loader.dataset_id
    whole = keys(mix(["cat", "dog", "truck"]).loader(4))
    again = resumed(lambda: mix(["cat", "dog", "truck"]).loader(4), state)
    assert_resumed_exactly(head, keys(again), whole)
    # A state of an earlier release (no "classes") still resumes.
    older = {k: v for k, v in state.items() if k != "classes"}
    assert keys(resumed(lambda: mix(["truck", "dog", "cat"]).loader(4), older)) == whole[8:]


# ------------------------------------------------------------------ the one loader


class _CountStarts:
    """A worker_init_fn that leaves one file per worker start (picklable for spawn)."""

    def __init__(self, where: pathlib.Path) -> None:
        self.where = str(where)

    def __call__(self, worker_id: int) -> None:
        open(os.path.join(self.where, f"{os.getpid()}-{worker_id}"), "w").close()


def test_a_mix_and_a_dataset_get_the_one_loader(sources):
    single = ShardDataset(sources[0])
    assert type(mixed(sources).loader(4)) is type(single.loader(4)) is ShardLoader


def test_a_mix_crosses_from_two_workers_over_the_ring_in_batch_reads(sources, payload):
    expected = keys(mixed(sources).loader(BATCH))
    loader = mixed(sources).loader(BATCH, 2)
    got = []
    try:
        for batch in loader:
            assert isinstance(batch["jpg"], ByteColumn)  # one buffer, not a list of bytes
            assert batch["__source__"].dtype == batch["cls"].dtype == torch.int64
            for key, data in zip(batch["__key__"], batch["jpg"], strict=True):
                assert bytes(data) == payload[key], key
            got += batch["__key__"]
        assert got == expected
        stats = loader.transport_stats
        assert stats["ring"] > 0 and stats["ring"] + stats["fallback"] == len(loader)
    finally:
        loader.close()


def test_a_mix_keeps_its_workers_across_epochs_and_close_stops_them(sources, tmp_path):
    loader = mixed(sources).loader(BATCH, 2, worker_init_fn=_CountStarts(tmp_path))
    whole = {}
    for epoch in range(2):
        loader.set_epoch(epoch)
        whole[epoch] = keys(loader)
        reference = mixed(sources)
        reference.set_epoch(epoch)
        assert whole[epoch] == keys(reference.loader(BATCH)), epoch
    assert whole[0] != whole[1]
    assert len(os.listdir(tmp_path)) == 2  # started once, kept for the second epoch
    batches = iter(loader)
    next(batches)
    loader.close()
    assert next(batches, None) is None  # the live iteration ended, its workers stopped
    loader.close()  # idempotent


@pytest.mark.parametrize("persistent", [True, False])
def test_a_mix_over_two_workers_resumes_exactly(sources, persistent):
    whole = keys(mixed(sources, seed=3).loader(BATCH, 2, persistent_workers=persistent))
    loader = mixed(sources, seed=3).loader(BATCH, 2, persistent_workers=persistent)
    head = take(loader, 5)
    state = saved(loader.state_dict())
    loader.close()
    again = resumed(lambda: mixed(sources, seed=3).loader(BATCH, 2), state)
    assert_resumed_exactly(head, keys(again), whole)
    assert again.metrics().sources == {"0": 200 - sum(1 for k in head if "/a_" in k),
                                       "1": 86 - sum(1 for k in head if "/b_" in k)}  # fmt: skip


def test_the_source_protocol_is_small_and_both_datasets_satisfy_it(sources):
    members = [m for m in vars(ReadSource) if not m.startswith("_")]
    assert len(members) <= 7, members
    for source in (
        ShardDataset(sources[0]),
        ShardDataset(sources[1], mode="stream"),
        mixed(sources),
    ):
        assert isinstance(source, ReadSource), type(source)
