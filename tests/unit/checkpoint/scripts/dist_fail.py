"""One rank of a two-rank gloo job whose saves fail on one rank only.

Usage: dist_fail.py CKPT_DIR OUT_DIR RANK WORLD PORT

Rank 0's commit of the step-10 checkpoint fails (rank 1 wrote its part fine); at step 40
rank 1 alone hands over a state a save refuses. Every rank catches CheckpointError and
UsageError and trains on; each call's outcome is recorded in OUT_DIR/rank-R.json. With a
rank one collective behind the others, the barriers at the end would time out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))

from shardio.checkpoint import Checkpointer, load_latest, writing
from shardio.errors import CheckpointError, UsageError


def main() -> None:
    ckdir, out_dir, rank_s, world_s, port = sys.argv[1:6]
    rank, world = int(rank_s), int(world_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=20),
    )  # fmt: skip
    real_commit = writing.commit

    def commit(plan, *args, **kwargs):
        if plan.step == 10:  # once rank 1 has done its part, as a real commit fails
            for _ in range(1000):
                if any(n.endswith(".json") for n in os.listdir(plan.temp_dir)):
                    break
                time.sleep(0.01)
            raise CheckpointError("injected: the commit of step 10 failed")
        return real_commit(plan, *args, **kwargs)

    if rank == 0:
        writing.commit = commit
    now = [0.0]
    saver = Checkpointer(ckdir, full_every_s=10, light_every_s=1000, per_rank=True,
                         clock=lambda: now[0], environ={"SLURM_JOB_ID": "777"})  # fmt: skip
    events: list[list] = []

    def call(what: str, step: int, fn) -> None:
        try:
            result = fn()
        except (CheckpointError, UsageError) as exc:
            events.append([what, step, "raised", type(exc).__name__, str(exc)[:300]])
        else:
            if result is not None:
                events.append([what, step, str(result)])

    state = lambda s: {"w": torch.full((100,), float(s * 10 + rank)), "step": s}  # noqa: E731
    for step in range(31):
        now[0] = float(step)
        call("maybe_save", step, lambda s=step: saver.maybe_save(s, full=lambda: state(s)))
        call("wait", step, saver.wait)
    bad = {"args": argparse.Namespace(lr=0.1)} if rank == 1 else state(40)
    call("save", 40, lambda: saver.save(bad, step=40))
    call("save", 41, lambda: saver.save(state(41), step=41))
    call("wait", 41, saver.wait)
    dist.barrier()  # the training's next collective: every rank reaches it
    call("close", 42, saver.close)
    dist.barrier()
    events.append(["loaded", load_latest(ckdir).step])
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as fh:
        json.dump(events, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
