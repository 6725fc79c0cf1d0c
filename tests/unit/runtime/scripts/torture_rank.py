"""One rank of a torch.distributed (gloo) job reading one epoch with recovery="skip".

Usage: python torture_rank.py SRC STAGE OUT_DIR RANK WORLD_SIZE PORT SEED BATCH
           [--resume CHECKPOINT] [--sleep-s S]

Reads ``ShardDataset(SRC, stage=STAGE, seed=SEED, recovery=RecoveryPolicy(policy="skip",
retries=1, backoff_s=0))`` with ``ds.loader(BATCH, num_workers=2)`` (STAGE ``-``: no staging
area, SRC read in place). The ranks stay in
lockstep (an all-reduce per step, as training does). After every batch it writes
OUT_DIR/rank-R/step-%06d.json (atomically): the batch's keys, the xxh3-128 of each delivered
payload, the labels, and ``loader.state_dict()``. At the end: OUT_DIR/rank-R/done.json with
the all-reduced sample counts and the recovery counts the training process saw.

``--resume`` loads a checkpoint's state first (its step numbering goes on from there);
``--sleep-s`` is the time a training step takes.

With the environment variable TORTURE_STALL_COPY=DIR, ``shardio.staging.copy.copy_verified``
is wrapped: once DIR/armed exists (a JSON list of shard paths relative to STAGE), a copy to
one of those runs, then (its temp file written, not yet published) creates DIR/stalled and
sleeps, so that the test can SIGKILL the job in the middle of a re-stage.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import xxhash

STALL_ENV = "TORTURE_STALL_COPY"


def write_json(path: str, data: object) -> None:
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.getpid()}-{os.path.basename(path)}")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def stall_copies(folder: str, stage: str) -> None:
    """Once ``folder``/armed exists, make verified copies to the shards it lists stall after
    writing their temp file (see the module doc). Installed before the DataLoader forks its
    workers."""
    from shardio.staging import copy as cache_copy
    from shardio.staging import verified

    original = cache_copy.copy_verified
    original_range = verified._copy_range

    def stalled_range(*args: Any, **kwargs: Any) -> int:
        copied = original_range(*args, **kwargs)
        write_json(os.path.join(folder, "stalled"), {"pid": os.getpid()})
        time.sleep(600)  # the test kills the job long before
        return copied

    def armed(dst: str) -> bool:
        try:
            with open(os.path.join(folder, "armed"), encoding="utf-8") as fh:
                chosen = json.load(fh)
        except FileNotFoundError:
            return False
        return os.path.relpath(dst, stage) in chosen

    def wrapped(src: str, dst: str, *args: Any, **kwargs: Any) -> int:
        if not armed(dst):
            return original(src, dst, *args, **kwargs)
        verified._copy_range = stalled_range
        try:
            return original(src, dst, *args, **kwargs)
        finally:
            verified._copy_range = original_range

    cache_copy.copy_verified = wrapped  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("src", "stage", "out_dir"):
        parser.add_argument(name)
    for name in ("rank", "world", "port", "seed", "batch"):
        parser.add_argument(name, type=int)
    parser.add_argument("--resume")
    parser.add_argument("--sleep-s", type=float, default=0.0)
    args = parser.parse_args()
    stall_dir = os.environ.get(STALL_ENV)
    if stall_dir:
        stall_copies(stall_dir, args.stage)

    from shardio.read.recovery import RecoveryPolicy
    from shardio.runtime.dataset import ShardDataset

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=60),
    )
    ds = ShardDataset(
        args.src,
        stage=None if args.stage == "-" else args.stage,
        seed=args.seed,
        recovery=RecoveryPolicy(policy="skip", retries=1, backoff_s=0.0),
    )
    loader = ds.loader(batch_size=args.batch, num_workers=2)
    out = os.path.join(args.out_dir, f"rank-{args.rank}")
    os.makedirs(out, exist_ok=True)
    step = 0
    if args.resume:
        with open(args.resume, encoding="utf-8") as fh:
            saved = json.load(fh)
        loader.load_state_dict(saved["state"])
        step = saved["step"] + 1
    delivered = 0
    for batch in loader:
        keys = list(batch["__key__"])
        payload = batch["bin"]
        record = {
            "step": step,
            "keys": keys,
            "digests": [xxhash.xxh3_128_hexdigest(bytes(payload[i])) for i in range(len(keys))],
            "labels": [int(v) for v in batch["cls"]],
            "state": loader.state_dict(),
        }
        write_json(os.path.join(out, f"step-{step:06d}.json"), record)
        # Lockstep, as a training step's gradient all-reduce keeps ranks.
        dist.all_reduce(torch.tensor([len(keys)], dtype=torch.int64))
        delivered += len(keys)
        step += 1
        time.sleep(args.sleep_s)
    count = torch.tensor([delivered], dtype=torch.int64)
    low, high = count.clone(), count.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    done = {
        "steps": step,
        "delivered": delivered,
        "len_loader": len(loader),
        "samples_per_rank": ds.samples_per_rank(),
        "min": int(low),
        "max": int(high),
        "recovery_stats": dict(ds.recovery_stats),
    }
    dist.barrier()
    dist.destroy_process_group()
    write_json(os.path.join(out, "done.json"), done)


if __name__ == "__main__":
    main()
