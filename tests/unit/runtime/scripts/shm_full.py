"""Read one epoch through ds.loader(num_workers=2) and print how it ended, as one JSON line.

Run by test_shm_full.py in a private mount namespace whose /dev/shm is a tiny tmpfs.

Usage: python shm_full.py DATASET TRANSPORT DECODE   (DECODE: "none" or "tensor")
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from shardio.runtime.dataset import ShardDataset


def _with_tensor(sample: dict[str, Any]) -> dict[str, Any]:
    """A decoder whose output is a tensor per sample (as decode="torch" gives)."""
    return {**sample, "pixels": torch.zeros(64 * 1024, dtype=torch.float32)}


def main() -> None:
    path, transport, decode = sys.argv[1:4]
    ds = ShardDataset(
        path, transport=transport, decode=_with_tensor if decode == "tensor" else None
    )
    batches = 0
    outcome: dict[str, Any] = {}
    try:
        for _batch in ds.loader(batch_size=64, num_workers=2):
            batches += 1
    except Exception as exc:  # what the training loop would see
        outcome = {"type": type(exc).__name__, "module": type(exc).__module__, "message": str(exc)}
    print(json.dumps({"batches": batches, **outcome}), flush=True)


if __name__ == "__main__":
    main()
