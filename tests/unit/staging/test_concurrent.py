"""Eight ranks of one node staging the same dataset into the same DEST at the same moment.

Real ``python -m shardio stage`` subprocesses, released together by a barrier file after
their imports (each copy is slowed a little so the eight really overlap): every shard is
copied exactly once over the eight, every process reports every shard, every staged shard
verifies, and no temp file is left.
"""

from __future__ import annotations

import multiprocessing
import re
import subprocess
from typing import Any

SUMMARY = re.compile(
    r"staged node 0/1: (\d+) of (\d+) shards .* copied (\d+) .*already staged and verified "
    r"(\d+), replaced (\d+)"
)
PROCS = 8


def test_eight_processes_copy_each_shard_once(big_src, tmp_path, stage_wrapper, child_env, helpers):
    dest = tmp_path / "nvme" / "stage"
    barrier = tmp_path / "go"
    env = child_env({"STAGE_TEST_BARRIER": str(barrier), "STAGE_TEST_DELAY_S": "0.01"})
    argv = stage_wrapper("stage", big_src.path, dest, "--no-progress", "--streams", "4")
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(PROCS)
    ]
    try:
        barrier.touch()
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    total = big_src.num_shards
    copied = present = replaced = 0
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
        assert "Traceback" not in err, err
        m = SUMMARY.search(out)
        assert m is not None, out
        staged, needed, c, pr, rp = map(int, m.groups())
        assert staged == needed == total, out
        assert c + pr + rp == total, f"a process did not account for every shard: {out}"
        copied, present, replaced = copied + c, present + pr, replaced + rp
    assert copied == total, f"{copied} copies of {total} shards over {PROCS} processes"
    assert replaced == 0
    assert present == (PROCS - 1) * total
    big_src.assert_staged_ok(dest, set(big_src.rels))
    assert big_src.stamped(dest) == set(big_src.rels)
    assert helpers.temp_files(dest) == []


def test_eight_api_processes_sum_of_copied(big_src, tmp_path, helpers):
    """The same through the Python API in 8 forked processes: sum(copied) == shards."""
    dest = tmp_path / "stage"
    ctx = multiprocessing.get_context("fork")
    results = ctx.SimpleQueue()
    go = ctx.Event()
    procs = [
        ctx.Process(target=_stage_api, args=(str(big_src.path), str(dest), go, results))
        for _ in range(PROCS)
    ]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"a staging process failed (exit code {p.exitcode})"
    got = [results.get() for _ in range(PROCS)]
    assert sum(c for c, _, _ in got) == big_src.num_shards
    assert all(c + p + r == big_src.num_shards for c, p, r in got)
    assert sum(r for _, _, r in got) == 0
    big_src.assert_staged_ok(dest, set(big_src.rels))
    assert helpers.temp_files(dest) == []


def _stage_api(src: str, dest: str, go: Any, results: Any) -> None:
    from shardio.staging import StageOptions, stage_dataset

    go.wait(30)
    result = stage_dataset(src, dest, StageOptions(streams=4, durable=False))
    results.put((result.copied, result.present, result.replaced))
