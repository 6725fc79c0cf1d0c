"""A training loop that checkpoints after every step and resumes from its latest checkpoint.

Usage: python train_loop.py DATASET CKPT_DIR --mode map|stream [--rank R --world-size W]
           [--init-state FILE] [--sleep-s 0.02] [--barrier DIR]

After each batch it writes CKPT_DIR/step-%06d.json (that batch's keys and the loader's
state_dict) atomically: a temp file, then os.replace. On start it loads the latest checkpoint
of CKPT_DIR if there is one, else --init-state's state if given (an elastic restart from
another job size). At the end of the epoch it writes CKPT_DIR/done.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time

from shardio.order.ranks import RankInfo
from shardio.runtime.dataset import ShardDataset


def write_json(path: str, data: object) -> None:
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.path.basename(path)}")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def wait_for_peers(barrier: str, rank: int, world: int) -> None:
    """Start the epoch together with the other ranks (stands in for a collective)."""
    os.makedirs(barrier, exist_ok=True)
    write_json(os.path.join(barrier, f"ready-{rank}.json"), {"rank": rank})
    deadline = time.monotonic() + 60
    while len(glob.glob(os.path.join(barrier, "ready-*.json"))) < world:
        if time.monotonic() > deadline:
            raise SystemExit("peers never came")
        time.sleep(0.005)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dataset")
    parser.add_argument("ckpt_dir")
    parser.add_argument("--mode", default="map")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--init-state")
    parser.add_argument("--sleep-s", type=float, default=0.02)
    parser.add_argument("--barrier")
    parser.add_argument("--seed", type=int, default=31)
    args = parser.parse_args()

    ds = ShardDataset(
        args.dataset,
        mode=args.mode,
        seed=args.seed,
        ranks=RankInfo(rank=args.rank, world_size=args.world_size),
    )
    loader = ds.loader(batch_size=16, num_workers=2)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    done = sorted(glob.glob(os.path.join(args.ckpt_dir, "step-*.json")))
    step = 0
    if done:
        with open(done[-1], encoding="utf-8") as fh:
            latest = json.load(fh)
        loader.load_state_dict(latest["state"])
        step = latest["step"] + 1
    elif args.init_state:
        with open(args.init_state, encoding="utf-8") as fh:
            loader.load_state_dict(json.load(fh)["state"])
    if args.barrier:
        wait_for_peers(args.barrier, args.rank, args.world_size)
    for batch in loader:
        record = {"step": step, "keys": batch["__key__"], "state": loader.state_dict()}
        write_json(os.path.join(args.ckpt_dir, f"step-{step:06d}.json"), record)
        step += 1
        time.sleep(args.sleep_s)
    write_json(os.path.join(args.ckpt_dir, "done.json"), {"steps": step})


if __name__ == "__main__":
    main()
