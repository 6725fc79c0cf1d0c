"""One rank of a torch.distributed (gloo) job that reads one epoch through ShardLoader.

Usage: python dist_epoch.py DATASET OUT_DIR RANK WORLD_SIZE PORT

Ranks come from the process group only (no RANK/WORLD_SIZE/SLURM variables are set), so
ShardDataset must detect them through torch.distributed. Writes OUT_DIR/rank-R.json with the
keys of every mode's epoch, the all-reduced sample counts and the rank's ``loader.metrics()``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from shardio.order.ranks import detect_ranks
from shardio.runtime.dataset import ShardDataset


def main() -> None:
    dataset, out_dir, rank_s, world_s, port = sys.argv[1:6]
    rank, world = int(rank_s), int(world_s)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    detected = detect_ranks()
    result: dict[str, object] = {
        "rank": rank,
        "detected": {
            "rank": detected.rank,
            "world_size": detected.world_size,
            "source": detected.source,
        },
    }
    for mode in ("map", "stream"):
        ds = ShardDataset(dataset, mode=mode, seed=17)
        loader = ds.loader(batch_size=16, num_workers=2)
        keys: list[str] = []
        batches = 0
        for batch in loader:
            keys.extend(batch["__key__"])
            batches += 1
        # Every rank must reach these collectives: unequal batch counts would hang a real
        # training step here instead.
        count = torch.tensor([len(keys)], dtype=torch.int64)
        total = count.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        low, high = count.clone(), count.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        result[mode] = {
            "keys": keys,
            "batches": batches,
            "len_loader": len(loader),
            "total": int(total),
            "min": int(low),
            "max": int(high),
            "metrics": loader.metrics().to_dict(),
        }
    dist.barrier()
    dist.destroy_process_group()
    tmp = os.path.join(out_dir, f".rank-{rank}.json.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(tmp, os.path.join(out_dir, f"rank-{rank}.json"))


if __name__ == "__main__":
    main()
