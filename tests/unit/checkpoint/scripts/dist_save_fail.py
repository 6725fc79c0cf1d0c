"""One rank of a two-rank gloo job whose module-level ``save()`` fails on one rank only.

Usage: dist_save_fail.py CKPT_DIR OUT_DIR RANK WORLD PORT

At step 1 rank 1's loader raises from ``state_dict()``; at step 2 rank 1 alone passes a bad
argument (``keep=0``); at step 3 ``load_latest`` gets a loader without ``load_state_dict`` on
rank 1 alone; then every rank saves and loads step 4. Each call's outcome is recorded in
OUT_DIR/rank-R.json. A rank left one collective behind would make the others time out.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))

from shardio.checkpoint import load_latest, save
from shardio.errors import ShardioError


class Loader:
    def __init__(self, broken: bool) -> None:
        self.broken = broken

    def state_dict(self) -> dict:
        if self.broken:
            raise RuntimeError("injected: the loader's state_dict() failed")
        return {"epoch": 0, "consumed": 8}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def main() -> None:
    ckdir, out_dir, rank_s, world_s, port = sys.argv[1:6]
    rank, world = int(rank_s), int(world_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=20),
    )  # fmt: skip
    env = {"SLURM_JOB_ID": "778"}
    events: list[list] = []

    def call(what: str, step: int, fn) -> None:
        try:
            result = fn()
        except (ShardioError, RuntimeError) as exc:
            events.append([what, step, "raised", type(exc).__name__, str(exc)[:300]])
        else:
            events.append([what, step, "ok", os.path.basename(str(result))])

    state = {"w": torch.ones(4)}
    opts = {"commit_timeout_s": 8.0}  # the old code's rank 0 waited this long for rank 1
    call("save", 1, lambda: save(state, ckdir, step=1, loader=Loader(rank == 1),
                                 environ=env, **opts))  # fmt: skip
    keep = 0 if rank == 1 else 3
    call("save", 2, lambda: save(state, ckdir, step=2, keep=keep, environ=env, **opts))
    bad = object() if rank == 1 else Loader(False)
    call("load", 3, lambda: load_latest(ckdir, loader=bad, environ=env).step)
    call("save", 4, lambda: save(state, ckdir, step=4, loader=Loader(False), environ=env,
                                 **opts))  # fmt: skip
    call("load", 4, lambda: load_latest(ckdir, loader=Loader(False), environ=env).step)
    dist.barrier()  # the training's next collective: every rank reaches it
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as fh:
        json.dump(events, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
