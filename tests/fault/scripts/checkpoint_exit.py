"""Saves a checkpoint in the background and exits at once (the final save, a SIGTERM handler).

Usage: checkpoint_exit.py CKPT_DIR MODE
  exit:    save step 7, then the script ends;
  sigterm: print "ready", then a SIGTERM handler saves step 8 and calls sys.exit(0).
Each write is held 0.5 s, so the save is still in flight when the interpreter exits.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))

from shardio.checkpoint import Checkpointer, writing

real_write = writing.write_rank


def slow_write(*args, **kwargs):
    time.sleep(0.5)
    return real_write(*args, **kwargs)


writing.write_rank = slow_write


def state(step: int) -> dict:
    return {"w": torch.arange(1 << 20, dtype=torch.float32) * step, "step": step}


def main() -> None:
    ckdir, mode = sys.argv[1:3]
    saver = Checkpointer(ckdir, environ={"SLURM_JOB_ID": "4242"})
    if mode == "exit":
        saver.save(state(7), step=7)
        return

    def on_term(signum, frame) -> None:
        saver.save(state(8), step=8)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    time.sleep(60)
    sys.exit(3)  # never signalled


if __name__ == "__main__":
    main()
