"""One rank of a torch.distributed (gloo) job that resumes an epoch from OUT_DIR/../state.json
(saved by a job of another size) and reads the rest of it, audited.

Usage: python dist_audit.py DATASET OUT_DIR RANK WORLD_SIZE PORT

Each rank writes OUT_DIR/rank-R.json with the audit's log lines and its counters.
"""

from __future__ import annotations

import json
import logging
import pathlib
import sys
from datetime import timedelta

import torch.distributed as dist

from shardio.runtime.dataset import ShardDataset


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def main() -> None:
    dataset, out_dir, rank_s, world_s, port = sys.argv[1:6]
    rank, world = int(rank_s), int(world_s)
    out = pathlib.Path(out_dir)
    lines = Lines()
    logging.getLogger("shardio.runtime.audit").addHandler(lines)
    logging.getLogger("shardio.runtime.audit").setLevel(logging.INFO)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    ds = ShardDataset(dataset, seed=5)
    loader = ds.loader(batch_size=20)
    state = out.parent / "state.json"
    samples = 0
    loader.load_state_dict(json.loads(state.read_text()))
    for batch in loader:
        samples += len(batch["__key__"])
    loader.close()
    dist.barrier()
    counters = loader.metrics().counters
    result = {
        "lines": lines.lines,
        "samples": samples,
        "audited": counters.get("epochs_audited"),
        "not_exact": counters.get("epochs_not_exact"),
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
