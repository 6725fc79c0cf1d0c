"""Shards truncated under a running training loop with the default transport: a typed error
(or, through ResilientDataset, a full epoch with substitutes), never SIGBUS, never a wrong
byte, also in the batches the loop still holds from before the truncation.

The loop runs in a child (scripts/sigbus_loop.py), so that a signal shows as its return code.
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from shardio.packing.run import PackOptions, pack
from shardio.read.journal import read_journal
from shardio.read.reader import ShardReader
from shardio.runtime.dataset import ShardDataset

NUM_FILES = 2400
SHARD_SIZE_BYTES = 8 * 1024  # about 4 samples a shard: many shards are still unread at first
SEED = 9
BATCH = 64  # sigbus_loop.py's
# Positions the loop may have read when it pauses: 2 delivered batches and the 8 that its 2
# workers prefetch (prefetch_factor 4), with room to spare.
READ_BEFORE_PAUSE = 16 * BATCH
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    """(tree, its packed dataset): NUM_FILES random files of 300-700 bytes in 4 class
    directories. Read-only: each test damages a copy."""
    base = tmp_path_factory.mktemp("sigbus")
    rng = random.Random(SEED)
    for i in range(NUM_FILES):
        folder = base / "tree" / f"class{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{i:04d}.bin").write_bytes(rng.randbytes(rng.randrange(300, 700)))
    pack(
        os.fspath(base / "tree"),
        os.fspath(base / "ds"),
        PackOptions(shard_size_bytes=SHARD_SIZE_BYTES, durable=False),
    )
    return base / "tree", base / "ds"


@pytest.fixture
def tree(packed: tuple[pathlib.Path, pathlib.Path]) -> pathlib.Path:
    return packed[0]


@pytest.fixture
def dataset(packed: tuple[pathlib.Path, pathlib.Path], tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of the packed dataset that the test may damage."""
    return pathlib.Path(shutil.copytree(packed[1], tmp_path / "ds"))


def payload_ranges(dataset: pathlib.Path) -> tuple[list[str], list[str], list[int], dict]:
    """(keys, shard rel paths, shard of each sample, sample -> (offset, end) of its payload)."""
    with ShardReader(dataset) as ds:
        keys = [ds.key(i) for i in range(len(ds))]
        rels = [s.path for s in ds.manifest.shards]
        shard_of = [ds.shard_of(i) for i in range(len(ds))]
        span = {}
        for i in range(len(ds)):
            for m in ds.index.sample_member_range(i):
                member = ds.index.members[m]
                if ds.index.exts[int(member["ext_id"])] == "bin":
                    span[i] = (int(member["offset"]), int(member["offset"] + member["size"]))
    return keys, rels, shard_of, span


def run_loop(
    scripts_dir: pathlib.Path,
    env: dict[str, str],
    dataset: pathlib.Path,
    tree: pathlib.Path,
    control: pathlib.Path,
    kind: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the loop; once it paused, truncate a shard it read and one it has not; return
    (what the child reported, with the epoch's order; what was truncated)."""
    control.mkdir()
    keys, rels, shard_of, span = payload_ranges(dataset)
    order = ShardDataset(dataset, seed=SEED).epoch_order().tolist()
    argv = [sys.executable, os.fspath(scripts_dir / "sigbus_loop.py"), os.fspath(dataset)]
    argv += [os.fspath(tree), os.fspath(control), str(SEED), kind]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (control / "ready.json").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.communicate(timeout=5)[0] if proc.poll() is not None else ""
                pytest.fail(f"the loop never paused (rc {proc.poll()}):\n{out}")
            time.sleep(0.005)
        got = json.loads((control / "ready.json").read_text())["keys"]
        # The shard of a held sample whose page lies wholly past the cut: a
        # mapping of it would fault there (SIGBUS).
        read = next(shard_of[s] for s in map(keys.index, got) if span[s][0] >= mmap.PAGESIZE)
        early = {shard_of[s] for s in order[:READ_BEFORE_PAUSE]}
        unread = next(shard_of[s] for s in order if shard_of[s] not in early)
        cuts = {}
        for shard in (read, unread):
            first = min(span[s] for s in range(len(keys)) if shard_of[s] == shard)
            cuts[shard] = (first[0] + first[1]) // 2  # inside the first payload: all damaged
            os.truncate(dataset / rels[shard], cuts[shard])
        (control / "go").write_text("")
        out = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    damaged = {
        keys[s] for s in range(len(keys)) if shard_of[s] in cuts and span[s][1] > cuts[shard_of[s]]
    }
    truncated = {
        "read": rels[read],
        "unread": rels[unread],
        "damaged": damaged,
        "unread_damaged": {keys[s] for s in range(len(keys)) if shard_of[s] == unread} & damaged,
    }
    assert proc.returncode != -signal.SIGBUS, f"the training process died of SIGBUS:\n{out}"
    assert proc.returncode == 0, f"rc {proc.returncode}:\n{out}"
    result = json.loads((control / "result.json").read_text())
    result["order"] = [keys[s] for s in order]
    return result, truncated


def test_truncated_shards_raise_a_typed_error_never_sigbus(
    scripts_dir, child_env, dataset, tree, tmp_path
):
    result, truncated = run_loop(
        scripts_dir, child_env(), dataset, tree, tmp_path / "control", "plain"
    )
    assert result["wrong"] == [], f"{len(result['wrong'])} sample(s) with wrong bytes"
    error = result["error"]
    # A full epoch would hold samples that no longer exist anywhere.
    assert error is not None, f"no error after {len(result['keys'])} samples"
    assert error["type"] in ("StorageError", "ChecksumMismatchError"), error
    assert truncated["read"] in error["message"] or truncated["unread"] in error["message"]
    assert not set(result["keys"]) & truncated["unread_damaged"]


def test_truncated_shards_are_substituted_under_skip(
    scripts_dir, child_env, dataset, tree, tmp_path
):
    control = tmp_path / "control"
    result, truncated = run_loop(scripts_dir, child_env(), dataset, tree, control, "resilient")
    assert result["wrong"] == [], f"{len(result['wrong'])} sample(s) with wrong bytes"
    assert result["error"] is None, result["error"]
    keys, order = result["keys"], result["order"]
    assert len(keys) == len(order) == NUM_FILES
    skips = [e for e in read_journal(control / "repairs.jsonl") if e["event"] == "skip"]
    substituted = {e["key"] for e in skips}
    # Every damaged sample not read before the cut was substituted, and nothing else was.
    assert truncated["unread_damaged"] <= substituted <= truncated["damaged"]
    substitutes = {(e["key"], e["substitute_key"]) for e in skips}
    for i, (want, got) in enumerate(zip(order, keys, strict=True)):
        if want in substituted:
            assert (want, got) in substitutes, f"position {i}: {want} -> {got}"
        else:
            assert got == want, f"position {i}: expected {want}, got {got}"
