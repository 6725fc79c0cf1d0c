"""Save checkpoints in a loop until killed: resume from the newest intact one, then save
steps after it, alternating the synchronous save and the Checkpointer, logging each step once
it is committed. Usage: checkpoint_loop.py CKPT_DIR LOG MIB."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from checkpointing import state_of

from shardio.checkpoint import Checkpointer, load_latest, save
from shardio.errors import NoCheckpointError


def main() -> None:
    directory, log, mib = sys.argv[1], sys.argv[2], float(sys.argv[3])
    try:
        step = load_latest(directory).step + 1
    except NoCheckpointError:
        step = 0
    env = {"SLURM_JOB_ID": str(os.getpid())}
    saver = Checkpointer(directory, keep_full=2, keep_light=1, environ=env)
    with open(log, "a", buffering=1) as out:
        while True:
            if step % 2:
                save(state_of(step, mib=mib), directory, step=step, keep=2, environ=env)
            else:
                saver.save(state_of(step, mib=mib), kind="light", step=step)
                saver.wait()
            out.write(f"{step}\n")
            step += 1


if __name__ == "__main__":
    main()
