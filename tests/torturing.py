"""The 2-rank gloo job of the torture runs (tests/unit/runtime/test_torture*.py): the tree,
the payload members of each shard, a byte flip, and starting, finishing and reading back
the job of scripts/torture_rank.py."""

from __future__ import annotations

import json
import os
import pathlib
import random
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
from killing import kill_session

from shardio.read.reader import ShardReader

NUM_FILES = 601  # odd: the last position of one rank is padding
SHARD_SIZE_BYTES = 32 * 1024  # about 9 samples a shard
ORDER_SEED = 11
FAULT_SEED = 20240607
BATCH = 16
WORLD = 2
PER_RANK = -(-NUM_FILES // WORLD)
JOB_TIMEOUT_S = 60


def write_tree(
    root: pathlib.Path, files: int = NUM_FILES
) -> tuple[dict[str, bytes], dict[str, int]]:
    """Random files of 1-2 KB in 4 class directories; (payload, label) by key."""
    rng = random.Random(FAULT_SEED + 1)
    payload, label = {}, {}
    for i in range(files):
        cls = i % 4
        folder = root / f"class{cls}"
        folder.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(rng.randrange(1000, 2000))
        (folder / f"f{i:04d}.bin").write_bytes(data)
        payload[f"class{cls}/f{i:04d}"] = data
        label[f"class{cls}/f{i:04d}"] = cls
    return payload, label


def payload_members(src: pathlib.Path) -> tuple[list[str], dict[str, list[tuple[str, int, int]]]]:
    """(keys in dataset order, rel -> (key, offset, size) of each payload member)."""
    with ShardReader(src) as ds:
        keys = [ds.key(i) for i in range(len(ds))]
        members: dict[str, list[tuple[str, int, int]]] = {s.path: [] for s in ds.manifest.shards}
        for i, key in enumerate(keys):
            rel = ds.manifest.shards[ds.shard_of(i)].path
            for m in ds.index.sample_member_range(i):
                member = ds.index.members[m]
                if ds.index.exts[int(member["ext_id"])] == "bin":
                    members[rel].append((key, int(member["offset"]), int(member["size"])))
    return keys, members


def flip(path: pathlib.Path, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0xFF]))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_job(
    script: pathlib.Path,
    src: pathlib.Path,
    stage: pathlib.Path,
    out: pathlib.Path,
    env: dict[str, str],
    *extra: str,
    resume: list[pathlib.Path] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start WORLD ranks, each in a session of its own (it and its loader workers)."""
    out.mkdir(parents=True)
    port = free_port()
    procs = []
    for r in range(WORLD):
        argv = [sys.executable, os.fspath(script), os.fspath(src), os.fspath(stage)]
        argv += [os.fspath(out), str(r), str(WORLD), str(port), str(ORDER_SEED), str(BATCH)]
        argv += [*extra, *(["--resume", os.fspath(resume[r])] if resume else [])]
        with open(out / f"rank-{r}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    return procs


def logs(out: pathlib.Path) -> str:
    return "\n".join(
        f"--- rank {r}:\n" + (out / f"rank-{r}.log").read_text(errors="replace")[-3000:]
        for r in range(WORLD)
    )


def kill_job(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        kill_session(proc.pid)
        proc.wait()


def finish_job(procs: list[subprocess.Popen[bytes]], out: pathlib.Path) -> None:
    """Wait for every rank to end well (a hang fails instead of blocking)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"the job did not finish in {JOB_TIMEOUT_S} s:\n{logs(out)}")
    finally:
        kill_job(procs)
    for r, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {r} failed (rc {proc.returncode}):\n{logs(out)}"


def steps_of(out: pathlib.Path, rank: int) -> list[dict[str, Any]]:
    """The checkpoints a rank wrote, in step order."""
    files = sorted((out / f"rank-{rank}").glob("step-*.json"))
    return [json.loads(p.read_text()) for p in files]


def read_run(out: pathlib.Path, rank: int) -> dict[str, Any]:
    steps = steps_of(out, rank)
    return {
        "keys": [k for s in steps for k in s["keys"]],
        "digests": [d for s in steps for d in s["digests"]],
        "labels": [v for s in steps for v in s["labels"]],
        "steps": steps,
        "done": json.loads((out / f"rank-{rank}" / "done.json").read_text()),
    }
