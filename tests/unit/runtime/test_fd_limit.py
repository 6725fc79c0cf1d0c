"""More shards than open files allowed: an epoch of 1,100 single-sample shards in random
order under ``ulimit -n 1024``, through 2 DataLoader workers and again in one process, which
then reads every shard: it must close shards it no longer needs, since holding all of them
open takes more descriptors than the process may have."""

from __future__ import annotations

import collections
import json
import os
import random
import resource
import subprocess
import sys

from shardio.packing.run import PackOptions, pack
from shardio.read.reader import ShardReader

NUM_FILES = 1100
NOFILE = 1024
TIMEOUT_S = 120


def _limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def test_an_epoch_over_more_shards_than_open_files_allowed(scripts_dir, child_env, tmp_path):
    tree = tmp_path / "tree"
    rng = random.Random(3)
    for i in range(NUM_FILES):
        folder = tree / f"class{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        # 1.1-1.5 KB: one sample (payload and label members) fills a 4 KiB shard.
        (folder / f"f{i:04d}.bin").write_bytes(rng.randbytes(rng.randrange(1100, 1500)))
    dataset = tmp_path / "ds"
    pack(
        os.fspath(tree),
        os.fspath(dataset),
        PackOptions(shard_size_bytes=4096, workers=2, durable=False),
    )
    with ShardReader(dataset) as ds:
        keys = [ds.key(i) for i in range(len(ds))]
        assert len(ds.manifest.shards) == NUM_FILES > NOFILE

    result = tmp_path / "result.json"
    argv = [sys.executable, os.fspath(scripts_dir / "fd_epoch.py"), os.fspath(dataset)]
    proc = subprocess.run(
        [*argv, os.fspath(tree), os.fspath(result)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        preexec_fn=_limit_open_files,  # as `ulimit -n 1024` in a job script
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = json.loads(result.read_text())
    assert got["nofile"] == [NOFILE, NOFILE]
    assert got["order"] == "random"
    for workers, run in got["passes"].items():
        assert run["wrong"] == [], f"{workers} workers: wrong bytes for {run['wrong'][:3]}"
        counts = collections.Counter(run["keys"])
        assert len(run["keys"]) == NUM_FILES, workers
        assert set(counts) == set(keys), workers
        assert max(counts.values()) == 1, workers
