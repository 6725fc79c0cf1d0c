"""The raw ceiling of shardio map mode's reads on a filesystem: preads in its order, no checksum.

``bench_pfs.py _child ceiling DATA RESULT [--batch-size B] [--workers N] [--seed S]
[--handshake]`` (bench_pfs.py's pinned part runs it beside the readers): the shardio tar
dataset's index and map mode's epoch order (``ShardDataset(DATA, mode="map",
seed=S).epoch_order()``), cut in batches of B dealt to N forked processes as the DataLoader
deals a map-style dataset's batches (batch b to worker b % N; N=0: this process), each
``preadv`` of every member of every sample of its batches into one reused buffer: no
checksum, no hand-off to a training process. Writes bench_read's result JSON (samples,
bytes, time_s; time from the handshake's GO, set-up included as for shardio).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import common
from pfs_pinned import process_cpu_s

# --------------------------------------------------------------------------------------------


def _read_share(
    fds: dict[int, int],
    shards: Any,
    offsets: Sequence[list[int]],
    sizes: Sequence[list[int]],
    batches: Sequence[Any],
    largest: int,
) -> tuple[int, int]:
    """pread every member of the samples of ``batches`` (arrays of sample ids) into one
    reused buffer of ``largest`` bytes; (samples, bytes)."""
    view = memoryview(bytearray(max(1, largest)))
    samples = nbytes = 0
    for batch in batches:
        for s in batch:
            fd = fds[int(shards[s])]
            for off, size in zip(offsets[s], sizes[s], strict=True):
                got = os.preadv(fd, [view[:size]], off)
                if got != size:
                    raise OSError(f"short read: {got} of {size} bytes at {off}")
                nbytes += got
            samples += 1
    return samples, nbytes


def ceiling_child(argv: Sequence[str]) -> int:
    """The raw ceiling of map mode's reads (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="bench_pfs.py _child ceiling")
    parser.add_argument("data")
    parser.add_argument("result")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--handshake", action="store_true")
    args = parser.parse_args(argv)
    import numpy as np
    import torch  # noqa: F401 - imported before the clock, as by the shardio child

    from shardio import ShardDataset, ShardReader

    if args.handshake:
        common.child_handshake()
    cpu0 = process_cpu_s()
    t0 = time.perf_counter()
    # Set-up as shardio's: the manifest, the index and the epoch's order, read cold.
    order = ShardDataset(args.data, mode="map", seed=args.seed).epoch_order()
    reader = ShardReader(args.data)
    index = reader.index
    first = index.samples["first_member"].astype(np.int64)
    counts = index.samples["n_members"].astype(np.int64)
    member_off = index.members["offset"].astype(np.int64)
    member_size = index.members["size"].astype(np.int64)
    offsets = [member_off[f : f + n].tolist() for f, n in zip(first, counts, strict=True)]
    sizes_of = [member_size[f : f + n].tolist() for f, n in zip(first, counts, strict=True)]
    shards = index.samples["shard"]
    fds = {
        i: os.open(reader.shard_path(i), os.O_RDONLY) for i in range(len(reader.manifest.shards))
    }
    batches = [order[i : i + args.batch_size] for i in range(0, len(order), args.batch_size)]
    largest = int(member_size.max()) if len(member_size) else 1
    workers = max(1, args.workers)
    if args.workers == 0:  # one process, as num_workers=0
        samples, nbytes = _read_share(fds, shards, offsets, sizes_of, batches, largest)
    else:
        # Batch b to worker b % N, as the DataLoader deals a map-style dataset's batches.
        pipes: list[tuple[int, int]] = []
        for w in range(workers):
            rfd, wfd = os.pipe()
            pid = os.fork()
            if pid == 0:  # the worker: read its share, report, leave without cleanup
                os.close(rfd)
                try:
                    got = _read_share(fds, shards, offsets, sizes_of, batches[w::workers], largest)
                    os.write(wfd, json.dumps(got).encode())
                    os._exit(0)
                except BaseException as exc:
                    os.write(2, f"ceiling worker {w}: {exc!r}\n".encode())
                    os._exit(1)
            os.close(wfd)
            pipes.append((pid, rfd))
        samples = nbytes = 0
        for pid, rfd in pipes:
            with os.fdopen(rfd, "rb") as fh:
                report = fh.read()
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0 or not report:
                raise SystemExit(f"a ceiling worker failed (status {status})")
            got = json.loads(report)
            samples += got[0]
            nbytes += got[1]
    t_end = time.perf_counter()
    cpu_s = process_cpu_s() - cpu0
    for fd in fds.values():
        os.close(fd)
    with open(args.result, "w") as fh:
        json.dump({"samples": samples, "bytes": nbytes, "time_s": t_end - t0, "cpu_s": cpu_s}, fh)
    return 0
