"""Run as one task of a job step: read a dataset with shardio's loader and record affinities.

    python affinity_probe.py DATASET OUTDIR

Writes ``OUTDIR/rank<SLURM_PROCID>.json``: the task's CPUs (``os.sched_getaffinity`` and
``/proc/self/status``), those of each of its threads while the loader runs, the samples it
read, and, from each DataLoader worker (its ``worker_init_fn`` runs after shardio pinned it),
the worker's CPUs and those of every thread it runs, one started there included.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import threading

from shardio import ShardDataset


def allowed_list(status: pathlib.Path) -> str:
    for line in status.read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise ValueError(f"no Cpus_allowed_list in {status}")


def threads() -> dict[str, str]:
    """Thread id -> its Cpus_allowed_list, for every thread of this process."""
    found = {}
    for task in pathlib.Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError, ValueError):  # a thread that ended meanwhile
            found[task.name] = allowed_list(task / "status")
    return found


class RecordWorker:
    """A picklable ``worker_init_fn``: write this worker's CPUs and its threads' CPUs."""

    def __init__(self, out: pathlib.Path) -> None:
        self.out = out

    def __call__(self, worker_id: int) -> None:
        started = threading.Thread(target=threading.Event().wait, args=(2.0,), daemon=True)
        started.start()
        record = {
            "pid": os.getpid(),
            "sched": sorted(os.sched_getaffinity(0)),
            "status": allowed_list(pathlib.Path("/proc/self/status")),
            "threads": threads(),
        }
        self.out.with_name(f"{self.out.stem}-worker{worker_id}.json").write_text(json.dumps(record))


def main() -> int:
    dataset, outdir = sys.argv[1], pathlib.Path(sys.argv[2])
    rank = os.environ["SLURM_PROCID"]
    out = outdir / f"rank{rank}.json"
    ds = ShardDataset(dataset, shuffle=False)
    loader = ds.loader(batch_size=2, num_workers=2, worker_init_fn=RecordWorker(out))
    keys: list[str] = []
    seen_threads: dict[str, str] = {}
    for batch in loader:
        keys.extend(batch["__key__"])
        seen_threads.update(threads())
    loader.close()
    record = {
        "pid": os.getpid(),
        "sched": sorted(os.sched_getaffinity(0)),
        "status": allowed_list(pathlib.Path("/proc/self/status")),
        "threads": seen_threads,
        "keys": keys,
        "bound_cpus": os.environ.get("SHARDIO_BOUND_CPUS"),
        "cpu_bind": os.environ.get("SLURM_CPU_BIND"),
    }
    out.write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
