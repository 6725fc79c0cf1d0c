"""Read one epoch of a dataset in map mode (random order) under the open-file limit the
test set (test_fd_limit.py): with ``ds.loader(batch_size=64, num_workers=2)``, then again
with the reads in this process (``num_workers=0``), where one process reads every shard.

Usage: python fd_epoch.py DATASET TREE RESULT_JSON

Compares every sample with its file in TREE and writes RESULT_JSON: per pass, the keys in
delivery order and the keys with wrong bytes; and the open-file limit it ran under.
"""

from __future__ import annotations

import json
import os
import resource
import sys

from shardio.runtime.dataset import ShardDataset


def main() -> None:
    dataset, tree, result = sys.argv[1:4]
    ds = ShardDataset(dataset, seed=5)
    passes = {}
    for workers in (2, 0):
        keys: list[str] = []
        wrong: list[str] = []
        for batch in ds.loader(batch_size=64, num_workers=workers):
            for i, key in enumerate(batch["__key__"]):
                keys.append(key)
                with open(os.path.join(tree, f"{key}.bin"), "rb") as fh:
                    if bytes(batch["bin"][i]) != fh.read():
                        wrong.append(key)
        passes[str(workers)] = {"keys": keys, "wrong": wrong}
    with open(result, "w", encoding="utf-8") as fh:
        json.dump(
            {
                "passes": passes,
                "nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
                "order": ds.order,
            },
            fh,
        )


if __name__ == "__main__":
    main()
