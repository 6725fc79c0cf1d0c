"""Iterate a ShardLoader for some epochs, with markers on stderr for an strace log.

Usage: python epoch_syscalls.py DATASET MODE CACHE EPOCHS WORKERS BATCH_SIZE [CONTEXT]

MODE is "map" or "stream"; CACHE is a staging area or "-" for none; CONTEXT is the workers'
start method ("fork", "spawn" or "forkserver", with torch and shardio preloaded; default: the
platform's). The training process
writes ``SHARDIO-MARK epoch-start E`` / ``epoch-end E`` around each epoch; each DataLoader
worker writes ``SHARDIO-MARK worker W epoch E`` when it starts, so every traced call can be
put down to the process that made it. Prints, as JSON on stdout, the keys of each batch of
each epoch, in the order delivered (batch b comes from worker b % WORKERS).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys

from torch.utils.data import get_worker_info

from shardio.order.ranks import RankInfo
from shardio.runtime.dataset import ShardDataset


def mark(text: str) -> None:
    os.write(2, f"SHARDIO-MARK {text}\n".encode())


def announce(worker: int) -> None:
    """worker_init_fn: name this process in the log (its calls follow under its pid)."""
    info = get_worker_info()
    assert info is not None
    mark(f"worker {worker} epoch {info.dataset.epoch}")


def main() -> None:
    path, mode, cache = sys.argv[1], sys.argv[2], sys.argv[3]
    epochs, workers, batch_size = (int(a) for a in sys.argv[4:7])
    extra: dict[str, object] = {}
    if len(sys.argv) > 7:
        context = multiprocessing.get_context(sys.argv[7])
        if sys.argv[7] == "forkserver":  # workers fork from a server that imported these
            context.set_forkserver_preload(["torch", "shardio.runtime.dataset", "__main__"])
        extra["multiprocessing_context"] = context
    ds = ShardDataset(
        path, mode=mode, stage=None if cache == "-" else cache, ranks=RankInfo(), seed=3
    )
    loader = ds.loader(
        batch_size, num_workers=workers, pin_workers=False, worker_init_fn=announce, **extra
    )
    epochs_read = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        mark(f"epoch-start {epoch}")
        epochs_read.append([list(batch["__key__"]) for batch in loader])
        mark(f"epoch-end {epoch}")
    ds.close()
    print(json.dumps(epochs_read))


if __name__ == "__main__":
    main()
