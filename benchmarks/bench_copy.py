#!/usr/bin/env python3
"""The verified staging copy of one shard (``shardio.staging.verified.copy_verified``): seconds for
a kernel copy into a temp file plus the hash of the copy, page cache warm.

``python benchmarks/bench_copy.py [--size-mib 1024] [--repeat 7] [--code DIR]``: ``--code``
imports shardio from another checkout (``git worktree add DIR REV``), so that two versions
are timed in one session, alternating. Prints the median; writes nothing (the figures of a
comparison go into benchmarks/RESULTS.md by hand, with the runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--code", help="a checkout to import shardio from")
    parser.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    args = parser.parse_args()
    if args.code:
        sys.path.insert(0, os.path.abspath(args.code))
    import xxhash

    try:
        import shardio.staging.verified as cache_copy
    except ImportError:  # a checkout from before the copy had its own module
        import shardio.staging.copy as cache_copy  # type: ignore[no-redef]
    from shardio.metrics.progress import Counters

    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        src = os.path.join(work, "shard-000000.tar")
        hasher = xxhash.xxh3_128()
        with open(src, "wb") as fh:
            for _ in range(args.size_mib):
                block = os.urandom(1 << 20)
                hasher.update(block)
                fh.write(block)
        size = os.path.getsize(src)
        times = []
        for i in range(args.repeat):
            dst = os.path.join(work, f"copy{i}.tar")
            began = time.perf_counter()
            cache_copy.copy_verified(
                src, dst, hasher.hexdigest(), size_bytes=size, durable=False,
                counters=Counters(shared=False),
            )  # fmt: skip
            times.append(time.perf_counter() - began)
            os.unlink(dst)
    median = statistics.median(times)
    print(f"{cache_copy.__file__}: {median:.3f} s median of {args.repeat} "
          f"({size / median / 1e9:.2f} GB/s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
