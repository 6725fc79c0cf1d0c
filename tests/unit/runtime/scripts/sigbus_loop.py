"""A training loop whose shards are truncated under it (test_sigbus.py).

Usage: python sigbus_loop.py DATASET TREE CONTROL_DIR SEED plain|resilient

Reads one epoch with ``ds.loader(batch_size=64, num_workers=2)`` and the default transport,
holding every batch. After the second batch it writes CONTROL_DIR/ready.json (the keys so
far) and waits for CONTROL_DIR/go, which the test writes once it has truncated shards.
Then it goes on. A ShardioError ends the epoch (reported, exit 0). At the end every sample
of every held batch, the earliest included, is compared with its file in TREE, and
CONTROL_DIR/result.json says what arrived: the keys, the count of wrong samples, the error.
A signal (SIGBUS from a mapped shard) kills the process instead: the test sees it as the
return code.

``resilient`` reads with recovery="skip", journaling to
CONTROL_DIR/repairs.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from shardio.errors import ShardioError
from shardio.read.recovery import RecoveryPolicy
from shardio.runtime.dataset import ShardDataset

BATCH = 64
READY_AFTER = 2  # batches
WAIT_S = 60


def write_json(path: str, data: object) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def wrong_samples(tree: str, batch: dict[str, Any]) -> list[str]:
    """Keys of the batch whose bytes differ from their source file."""
    wrong = []
    for i, key in enumerate(batch["__key__"]):
        with open(os.path.join(tree, f"{key}.bin"), "rb") as fh:
            if bytes(batch["bin"][i]) != fh.read():
                wrong.append(key)
    return wrong


def main() -> None:
    dataset, tree, control, seed, kind = sys.argv[1:6]
    policy = RecoveryPolicy(
        policy="skip", retries=1, backoff_s=0.0, journal=os.path.join(control, "repairs.jsonl")
    )
    ds: Any = ShardDataset(
        dataset, seed=int(seed), recovery=policy if kind == "resilient" else None
    )
    held: list[dict[str, Any]] = []
    wrong: list[str] = []
    error = None
    try:
        for batch in ds.loader(batch_size=BATCH, num_workers=2):
            held.append(batch)
            wrong += wrong_samples(tree, batch)
            if len(held) == READY_AFTER:
                keys = [k for b in held for k in b["__key__"]]
                write_json(os.path.join(control, "ready.json"), {"keys": keys})
                deadline = time.monotonic() + WAIT_S
                while not os.path.exists(os.path.join(control, "go")):
                    if time.monotonic() > deadline:
                        raise SystemExit("the test never said go")
                    time.sleep(0.005)
    except ShardioError as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
    # The earliest batches again, after the truncation: their bytes must not have changed.
    for batch in held:
        wrong += wrong_samples(tree, batch)
    write_json(
        os.path.join(control, "result.json"),
        {
            "keys": [k for b in held for k in b["__key__"]],
            "wrong": sorted(set(wrong)),
            "error": error,
            "transport": ds.transport,
        },
    )


if __name__ == "__main__":
    main()
