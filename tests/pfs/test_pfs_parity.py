"""A dead data server under a dataset stored with one copy, healed by its parity, on the real
MooseFS bed.

Three chunkservers carry labels A, B and C (scripts/pfs/moosefs.sh); storage classes place
each file of a ``--parity 2+1`` dataset with one copy on one of them, as an operator places
erasure-coded fragments on distinct failure domains: the first shard of each group on A, the
second on B, the parity files and cell tables on C (the manifest, index and DALI indexes
keep a copy on every server: nothing reads without them). Chunkserver A is then stopped: half
the shards have no live copy. ``ResilientDataset`` rebuilds each stalled shard from the rest
of its group and the epoch delivers every sample, right, substituting **none**; in the other
test ``shardio verify --repair`` rebuilds them, onto the live servers.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import xxhash
from mfsbed import Bed, forget_bed_holds, wait_for

pytest.importorskip("pyeclib")

from shardio.format.manifest import load_manifest

_EPOCH = """
import json, os, sys, time
import xxhash
from shardio import RecoveryPolicy, ShardDataset, ShardLoader
args = json.loads(sys.argv[1])
ds = ShardDataset(args["root"], read_timeout_s=5,
                  recovery=RecoveryPolicy(policy="skip", journal=args["journal"]))
loader = ShardLoader(ds, batch_size=8, num_workers=2)
began, got = time.monotonic(), {}
for batch in loader:
    for key, payload in zip(batch["__key__"], batch["bin"]):
        got[key] = xxhash.xxh3_64_hexdigest(bytes(payload))
out = {"got": got, "epoch_s": time.monotonic() - began,
       "counters": dict(loader.metrics().counters)}
json.dump(out, open(args["out"], "w"))
sys.stdout.flush()
os._exit(0)  # not waiting for I/O threads a dead server still holds
"""


def _tree(root: pathlib.Path) -> dict[str, str]:
    """96 files of 20-60 KB in 3 classes; key -> xxh3-64 of the payload."""
    import random

    rng = random.Random(5)
    truth = {}
    for i in range(96):
        key = f"c{i % 3}/{i:04d}"
        data = rng.randbytes(rng.randrange(20_000, 60_000))
        (root / f"{key}.bin").parent.mkdir(parents=True, exist_ok=True)
        (root / f"{key}.bin").write_bytes(data)
        truth[key] = xxhash.xxh3_64_hexdigest(data)
    return truth


def _placed(bed: Bed, tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, str], set[str]]:
    """Pack onto the bed with --parity 2+1 and place every file; (dataset, truth, the shards
    on A)."""
    for label in "ABC":
        bed.admin("mfsscadmin", str(bed.mount), "create", "-m", "L", "-K", label, f"sio_{label}")
    truth = _tree(tmp_path / "tree")
    root = bed.mount / "par" / "ds"
    root.parent.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "shardio", "pack", str(tmp_path / "tree"), str(root),
         "--shard-size", "512KiB", "--parity", "2+1", "--no-progress"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    man = load_manifest(root / "manifest.json")
    assert man.parity is not None and len(man.parity.groups) >= 3
    where: dict[pathlib.Path, int] = {}
    on_a = set()
    for group in man.parity.groups:
        for n, i in enumerate(group.shards):
            where[root / man.shards[i].path] = 1 + n  # A, then B
            if n == 0:
                on_a.add(man.shards[i].path)
        for f in group.files():
            where[root / f.path] = 3  # C
    for path, cs in where.items():
        bed.admin("mfssetsclass", f"sio_{'ABC'[cs - 1]}", str(path))
    everywhere = [root / "manifest.json", root / "index.bin", root / "pack-report.json"]
    everywhere += [root / s.dali_index for s in man.shards if s.dali_index]
    bed.admin("mfssetgoal", "3", *map(str, everywhere))
    # MooseFS moves chunks to their storage class in the background, slower on a loaded machine.
    wait_for(lambda: all(bed.copies(p) == [cs] for p, cs in where.items()), "the placement", 240)
    wait_for(lambda: all(len(bed.copies(p)) == 3 for p in everywhere), "three copies", 240)
    return root, truth, on_a


def _kill_a(bed: Bed) -> None:
    bed.stop_chunkserver(1)
    os.sync()
    pathlib.Path("/proc/sys/vm/drop_caches").write_text("3\n")
    forget_bed_holds()  # holds of an earlier run of the same path must not help this one


@pytest.fixture
def bed3(private_bed: Callable[..., Bed]) -> Bed:
    return private_bed(chunkservers=3, ioretries=3, goal=1)


def test_resilient_dataset_rebuilds_the_dead_servers_shards_and_substitutes_none(
    bed3: Bed, tmp_path: pathlib.Path
) -> None:
    root, truth, on_a = _placed(bed3, tmp_path)
    _kill_a(bed3)
    out, journal = tmp_path / "epoch.json", tmp_path / "repairs.jsonl"
    spec = json.dumps({"root": str(root), "out": str(out), "journal": str(journal)})
    began = time.monotonic()
    subprocess.run([sys.executable, "-c", _EPOCH, spec], timeout=200, check=False,
                   capture_output=True)  # fmt: skip
    result: dict[str, Any] = json.loads(out.read_text())
    c = result["counters"]
    print(
        f"\n[parity 2+1, chunkserver A dead] epoch {result['epoch_s']:.1f} s "
        f"({time.monotonic() - began:.1f} s with start-up), rebuild events {c['rebuilds']}, "
        f"stalls {c['stalls']}, substitutes {c['substitutes']}"
    )
    assert result["got"] == truth  # every sample, each byte the packed one
    assert c["substitutes"] == 0 and c["unavailable"] == 0
    events = [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]
    rebuilt = {e["shard"] for e in events if e["event"] == "rebuild" and e["wrote"]}
    assert rebuilt == on_a  # written once each; a shard held only for the mount's stall is not
    assert {e["shard"] for e in events if e["event"] == "rebuild"} <= {
        s.path for s in load_manifest(root / "manifest.json").shards
    }
    assert not [e for e in events if e["event"] in ("skip", "raise")]
    for rel in on_a:  # rebuilt onto the live servers
        assert 1 not in bed3.copies(root / rel)
    proc = subprocess.run([sys.executable, "-m", "shardio", "verify", str(root), "--no-progress"],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_verify_repair_rebuilds_them_onto_the_live_servers(
    bed3: Bed, tmp_path: pathlib.Path
) -> None:
    root, _truth, on_a = _placed(bed3, tmp_path)
    _kill_a(bed3)

    def shardio(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "shardio", *args, str(root), "--no-progress"],
            capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip

    found = shardio("verify")
    assert found.returncode == 3, found.stdout + found.stderr
    assert f"parity can rebuild {len(on_a)} of the damaged shards" in found.stderr
    repaired = shardio("verify", "--repair")
    assert repaired.returncode == 4, repaired.stdout + repaired.stderr
    for rel in on_a:
        assert f"repaired {rel} (" in repaired.stdout
        assert 1 not in bed3.copies(root / rel)
    assert shardio("verify").returncode == 0
