"""One rank of a torch.distributed (gloo) job that saves or loads checkpoints.

Usage: dist_ckpt.py ACTION CKPT_DIR OUT_DIR RANK WORLD PORT
  save: per-rank checkpoints (step 1 by save(), steps 10, 20 by a Checkpointer's cadence,
        rank 0's clock deciding) in CKPT_DIR/per-rank, replicated ones in CKPT_DIR/replicated;
  load: load_latest from both; writes OUT_DIR/rank-R.json.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))

from shardio.checkpoint import Checkpointer, load_latest, save
from shardio.errors import CheckpointError


def rank_state(step: int, rank: int) -> dict:
    return {"w": torch.full((1000,), float(step * 100 + rank)), "rank": rank, "step": step}


def main() -> None:
    action, ckdir, out_dir, rank_s, world_s, port = sys.argv[1:7]
    rank, world = int(rank_s), int(world_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    env = {"SLURM_JOB_ID": "555"}
    per_rank, replicated = os.path.join(ckdir, "per-rank"), os.path.join(ckdir, "replicated")
    result: dict = {"rank": rank}
    if action == "save":
        result["paths"] = [
            save(rank_state(1, rank), per_rank, step=1, per_rank=True, environ=env),
            save(rank_state(1, rank), replicated, step=1, environ=env),
        ]
        now = [0.0]
        clock = (lambda: now[0]) if rank == 0 else (lambda: 0.0)  # rank 0's clock decides
        saver = Checkpointer(per_rank, full_every_s=10, light_every_s=5, per_rank=True,
                             clock=clock, environ=env)  # fmt: skip
        kinds = []
        for step in range(0, 21):
            now[0] = float(step)
            kinds.append(saver.maybe_save(step, full=lambda s=step: rank_state(s, rank)))
            saver.wait()
        saver.close()
        result["kinds"] = [k for k in kinds if k]
        result["saved_steps"] = [s for s, k in enumerate(kinds) if k]
    else:
        for name, folder in (("per_rank", per_rank), ("replicated", replicated)):
            try:
                ck = load_latest(folder)
            except CheckpointError as exc:  # not NoCheckpointError: they exist, none loads
                result[name] = {"error": str(exc), "type": type(exc).__name__}
                continue
            result[name] = {
                "step": ck.step, "state_rank": ck.state["rank"], "state_step": ck.state["step"],
                "w0": float(ck.state["w"][0]), "skipped": ck.skipped,
            }  # fmt: skip
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
