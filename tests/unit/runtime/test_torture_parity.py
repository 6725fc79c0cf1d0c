"""The torture run of the read path on a dataset with parity and no source tree: faults in
its shards are rebuilt during the epoch, in a real 2-rank gloo job with 2 loader workers.

About 70 tar shards packed with ``--parity 4+2``; the source tree is deleted; then bytes
flipped inside members, shards truncated and deleted, two shards of some groups damaged at
once, parity files and a cell table damaged too (at most M bad files per group). Each rank
reads one epoch through ``ShardDataset(recovery="skip")`` straight from the dataset
(scripts/torture_rank.py with no staging area). Every sample must arrive, right and in order,
with **no** substitute; the data shards end byte-identical to the packed ones; the parity
damage reading cannot see is left to ``verify --repair``, which then makes all of it whole
(a damaged cell table met by a rebuild is written again at once).
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
from typing import Any

import pytest
import xxhash
from torturing import (
    BATCH,
    NUM_FILES,
    ORDER_SEED,
    PER_RANK,
    SHARD_SIZE_BYTES,
    WORLD,
    finish_job,
    flip,
    payload_members,
    read_run,
    start_job,
    write_tree,
)

pytest.importorskip("pyeclib")

from shardio.format.manifest import load_manifest
from shardio.packing.run import PackOptions, pack
from shardio.runtime.dataset import ShardDataset
from shardio.tools.repair import repair_dataset
from shardio.tools.verify import verify_dataset

SEED = 777


def _tree_files(root: pathlib.Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.relative_to(root).as_posix().startswith("parity/.locks")
    }


@pytest.fixture(scope="module")
def healed(tmp_path_factory: pytest.TempPathFactory, scripts_dir: pathlib.Path,
           child_env: Any) -> dict[str, Any]:  # fmt: skip
    base = tmp_path_factory.mktemp("torture-parity")
    payload, label = write_tree(base / "tree")
    src = base / "src"
    pack(os.fspath(base / "tree"), os.fspath(src),
         PackOptions(shard_size_bytes=SHARD_SIZE_BYTES, durable=False, parity="4+2"))  # fmt: skip
    shutil.rmtree(base / "tree")  # no source tree: parity is the only way back
    original = _tree_files(src)
    keys, members = payload_members(src)
    man = load_manifest(src / "manifest.json")
    assert man.parity is not None and len(man.parity.groups) >= 15
    rng = random.Random(SEED)
    groups = list(range(len(man.parity.groups) - 1))  # the short last group stays clean
    rng.shuffle(groups)
    damaged_data: list[str] = []
    damaged_parity: list[str] = []

    def hurt(rel: str, n: int) -> None:
        path = src / rel
        kind = n % 3
        if rel.startswith("parity/") or kind == 0:
            if members.get(rel):
                _key, offset, size = rng.choice(members[rel])
                flip(path, offset + rng.randrange(size))
            else:
                flip(path, rng.randrange(path.stat().st_size))
        elif kind == 1:
            os.truncate(path, path.stat().st_size // 2)
        else:
            path.unlink()

    n = 0
    for i, g in enumerate(groups[:14]):
        group = man.parity.groups[g]
        shards = [man.shards[s].path for s in group.shards]
        if i < 8:  # one data shard
            chosen = [rng.choice(shards)]
        elif i < 11:  # two data shards of the group at once
            chosen = rng.sample(shards, 2)
        else:  # a data shard, and a parity file or the cell table of the same group
            chosen = [rng.choice(shards)]
            other = rng.choice([group.parity[0].path, group.parity[1].path, group.cells.path])
            damaged_parity.append(other)
            hurt(other, n)
        for rel in chosen:
            hurt(rel, n)
            n += 1
        damaged_data += chosen
    out = base / "run"
    finish_job(start_job(scripts_dir / "torture_rank.py", src, pathlib.Path("-"), out,
                         child_env()), out)  # fmt: skip
    return {
        "src": src, "payload": payload, "label": label, "keys": keys, "original": original,
        "data": damaged_data, "parity": damaged_parity,
        "runs": [read_run(out, r) for r in range(WORLD)],
    }  # fmt: skip


def test_every_sample_arrives_right_and_in_order_with_no_substitute(healed: dict[str, Any]) -> None:
    order = [healed["keys"][i] for i in ShardDataset(healed["src"], seed=ORDER_SEED).epoch_order()]
    padded = order + order[: PER_RANK * WORLD - len(order)]
    rebuilds = 0
    for r, run in enumerate(healed["runs"]):
        done = run["done"]
        assert done["delivered"] == done["min"] == done["max"] == PER_RANK, (r, done)
        assert done["steps"] == -(-PER_RANK // BATCH)
        assert run["keys"] == padded[r::WORLD], f"rank {r}: not the fault-free order"
        for key, digest, cls in zip(run["keys"], run["digests"], run["labels"], strict=True):
            assert digest == xxhash.xxh3_128_hexdigest(healed["payload"][key]), key
            assert cls == healed["label"][key]
        stats = done["recovery_stats"]
        assert stats["skip"] == 0 and stats["raise"] == 0, stats
        rebuilds += stats["rebuild"]
    assert len(healed["data"]) >= 17
    assert rebuilds >= len(healed["data"])  # each damaged shard rebuilt (a waiting rank counts)
    assert len(healed["keys"]) == NUM_FILES


def test_the_data_shards_end_byte_identical_and_repair_finishes_the_parity(
    healed: dict[str, Any],
) -> None:
    src, original = healed["src"], healed["original"]
    now = _tree_files(src)
    for rel in healed["data"]:
        assert now[rel] == original[rel], f"{rel} was not rebuilt exactly"
    report = verify_dataset(src)
    # A cell table the rebuild found damaged was written again then; parity files are not
    # read by a rebuild that does not need them.
    left = {rel for rel in healed["parity"] if not rel.endswith(".cells")}
    assert left and {p.path for p in report.problems} == left
    assert report.status == "degraded"  # training data intact, some parity not
    fixed = repair_dataset(src)
    assert fixed.status == "repaired", fixed.unrepaired
    assert _tree_files(src) == original
    assert not [p for p in src.rglob("*") if ".shardio-tmp-" in p.name]
