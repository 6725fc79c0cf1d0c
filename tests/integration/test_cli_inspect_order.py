"""``shardio inspect --order SPEC`` and ``--orders``: the shuffle quality of an order before
training, equal to what ShardDataset then delivers; every option's mistakes as one line."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np
import pytest
from trees import write_tree

from shardio.order import OrderSpec
from shardio.order.quality import QualityAccumulator, dataset_label_entropy, order_quality
from shardio.packing.run import PackOptions, pack
from shardio.read.reader import ShardReader

CLASSES, PER_CLASS = 4, 24


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """96 samples of 4 classes (packed class by class) in 8 or so shards."""
    root = tmp_path_factory.mktemp("order")
    files = {
        f"c{c}/img{i:03d}.jpg".encode(): bytes([c, i]) * 700
        for c in range(CLASSES)
        for i in range(PER_CLASS)
    }
    src = write_tree(root / "src", files)
    dst = root / "ds"
    result = pack(src, os.fspath(dst), PackOptions(shard_size_bytes=16 * 1024, durable=False))
    assert result.num_shards >= 6
    return dst


def _library(dst: pathlib.Path, spec: OrderSpec, **kw: Any) -> dict[str, Any]:
    with ShardReader(os.fspath(dst)) as reader:
        sizes = [s.num_samples for s in reader.manifest.shards]
        return order_quality(sizes, reader.index.samples["label"], spec, **kw).to_dict()


def test_order_json_is_the_library_figure_and_text_shows_it(
    run_cli: Any, dataset: pathlib.Path
) -> None:
    result = run_cli("inspect", dataset, "--order", "sequential", "--batch-size", "8", "--json")
    assert result.rc == 0, result.stderr
    found = json.loads(result.stdout)["order_quality"]
    assert found == _library(dataset, OrderSpec(order="sequential"), batch_size=8)
    assert found["rho"] == pytest.approx(1.0) and found["batches"] == 12
    assert found["label_entropy"] < 0.2  # packed class by class: batches of one class
    text = run_cli("inspect", dataset, "--order", "sequential", "--batch-size", "8")
    assert text.rc == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == "order          order=sequential,seed=0,window=4,partition=none,drop_last=0"
    assert lines[1] == "epoch          0, batches of 8: all 12 batches measured"
    assert "storage order  rho=1.000 (1: sequential, about 0: shuffled)" in lines
    assert any(line.startswith("memory         ") and "as an array 768 B" in line for line in lines)


def test_the_figures_are_those_of_what_the_dataset_delivers(
    run_cli: Any, dataset: pathlib.Path
) -> None:
    """inspect --order before training == the batches ShardDataset hands out in that epoch."""
    from shardio import ShardDataset

    result = run_cli(
        "inspect", dataset, "--order", "order=shard-local,window=2,seed=9", "--batch-size", "10",
        "--epoch", "3", "--json",
    )  # fmt: skip
    assert result.rc == 0, result.stderr
    promised = json.loads(result.stdout)["order_quality"]
    ds = ShardDataset(os.fspath(dataset), order="order=shard-local,window=2,seed=9")
    ds.cursor.set_epoch(3)
    delivered = ds.rank_indices()
    records = ds.packed.index.samples
    acc = QualityAccumulator(dataset_entropy=dataset_label_entropy(records["label"]))
    for start in range(0, len(delivered), 10):
        idx = delivered[start : start + 10]
        acc.observe(3, idx, records["label"][idx], ds.packed.index.shards_of(idx))
    seen = acc.end_epoch(3).to_dict()
    ds.close()
    for key in ("label_entropy", "label_entropy_p5", "shards_per_batch", "rho"):
        assert seen[key] == pytest.approx(promised[key], abs=1e-12), key
    assert seen["batches"] == promised["batches"] == 10


def test_orders_compares_the_standard_orders(run_cli: Any, dataset: pathlib.Path) -> None:
    result = run_cli("inspect", dataset, "--orders", "--batch-size", "8", "--nodes", "2", "--json")
    assert result.rc == 0, result.stderr
    doc = json.loads(result.stdout)
    names = [o["name"] for o in doc["orders"]]
    assert names == ["random", "shard-local, window 4", "sequential", "partition=node"]
    assert (doc["samples"], doc["classes"], doc["nodes"]) == (96, CLASSES, 2)
    by_name = {o["name"]: o for o in doc["orders"]}
    assert by_name["partition=node"]["nodes"] == 2
    assert by_name["random"]["label_entropy"] > by_name["sequential"]["label_entropy"]
    text = run_cli("inspect", dataset, "--orders", "--batch-size", "8")
    assert text.rc == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].endswith(
        f"96 samples in {doc['shards']} shards, 4 classes; epoch 0, batches of 8"
    )
    assert lines[1].split() == [
        "order", "entropy", "(p5)", "shards/batch", "/window", "switches", "rho", "memory"
    ]  # fmt: skip
    assert lines[2].startswith("random ") and lines[5].startswith("partition=node, 4 nodes ")
    assert lines[4].split()[-3] == "1.000"  # sequential: rho 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--order", "random", "--batch-size", "0"], "--batch-size must be between 1 and"),
        (["--order", "random", "--batch-size", "-1"], "--batch-size='-1' is not a whole number"),
        (["--order", "random", "--batch-size", "12x"], "--batch-size='12x' is not a whole"),
        (["--order", "random", "--batch-size", "2000000"], "between 1 and 1,048,576"),
        (["--order", "random", "--batch-size", "97"], "larger than the dataset's 96 samples"),
        (["--order", "random", "--epoch", "-1"], "--epoch='-1' is not a whole number"),
        (["--order", "random", "--epoch", "9223372036854775808"], "--epoch must be below"),
        (["--order", "random", "--nodes", "2"], "nodes apply to a partitioned order"),
        (["--order", "partition=node", "--nodes", "0"], "--nodes must be between 1 and"),
        (["--order", "partition=node", "--nodes", "500"], "at least one shard per node"),
        (["--order", "order=bogus"], "invalid order 'bogus'"),
        (["--order", "random", "--orders"], "not allowed with argument --order"),
        (["--batch-size", "8"], "--batch-size measures an order: give --order SPEC"),
        (["--epoch", "1"], "--epoch measures an order"),
    ],
)
def test_mistakes_are_one_line(
    run_cli: Any, run_cli_here: Any, assert_cli_error: Any, dataset: pathlib.Path,
    args: list[str], needle: str,
) -> None:  # fmt: skip
    run = run_cli if needle.startswith("larger than") else run_cli_here  # one: the command
    result = run("inspect", dataset, *args)
    assert_cli_error(result, needle)
    assert result.rc == 2


def test_no_labels_says_so(run_cli: Any, tmp_path: pathlib.Path, dataset: pathlib.Path) -> None:
    src = write_tree(tmp_path / "flat", {f"f{i:03d}.bin".encode(): b"x" * 100 for i in range(40)})
    dst = tmp_path / "ds"
    pack(src, os.fspath(dst), PackOptions(shard_size_bytes=4096, durable=False, labels="none"))
    result = run_cli("inspect", dst, "--order", "shard-local", "--batch-size", "4")
    assert result.rc == 0, result.stderr
    assert "label entropy  no labels" in result.stdout.splitlines()
    assert np.isfinite(json.loads(run_cli("inspect", dst, "--orders", "--json").stdout)
                       ["orders"][0]["shards_per_batch"])  # fmt: skip
