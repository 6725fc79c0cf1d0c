"""One loader: a 2-source mix against a single dataset of the same samples, through the same
``ds.loader(batch_size=64, num_workers=2)`` over the ring transport.

Both read the same bytes (the single dataset is the two sources' files packed together), warm
(one untimed epoch first), in alternating rounds so that a noisy neighbour hits both alike.
Each round times one epoch of each in a child process (``_epoch``), reporting samples/s, MB/s
and the CPU seconds (the child and its DataLoader workers) per verified GB. The section "One
loader: a mix against a single dataset" of RESULTS.md gets the medians and the ratio.

Usage: ``python benchmarks/bench_mix.py [--samples N] [--size BYTES] [--rounds R]
[--no-write]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## One loader: a mix against a single dataset"


def _write_files(src: str, prefix: str, files: int, size: int) -> None:
    rng = random.Random(prefix)
    for i in range(files):
        folder = os.path.join(src, f"c{i % 4}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{prefix}_{i:06d}.jpg"), "wb") as fh:
            fh.write(rng.randbytes(size))


def _pack(src: str, out: str) -> str:
    from shardio.packing.run import PackOptions, pack

    pack(src, out, PackOptions(shard_format="tar", shard_size_bytes=8 << 20, durable=False))
    return out


def _cpu_s() -> float:
    """User + system CPU seconds of this process and its reaped children (the workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    workers = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime


def _epoch_child(argv: list[str]) -> int:
    """``bench_mix.py _epoch KIND PATH[,PATH]``: one warm-up epoch, then one timed epoch."""
    kind, paths = argv[0], argv[1].split(",")
    from shardio import MixedDataset, ShardDataset

    if kind == "mix":
        ds = MixedDataset([(ShardDataset(p, seed=1), 1.0) for p in paths])
    else:
        ds = ShardDataset(paths[0], seed=1)
    loader = ds.loader(batch_size=64, num_workers=2)
    try:
        for _ in loader:  # warm: the page cache and the workers' first imports
            pass
        loader.set_epoch(1)
        samples = nbytes = 0
        cpu_before = _cpu_s()
        began = time.perf_counter()
        for batch in loader:
            samples += len(batch["__key__"])
            column = batch["jpg"]
            nbytes += sum(len(column[i]) for i in range(len(column)))
        wall = time.perf_counter() - began
        ring = loader.transport_stats["ring"]
    finally:
        loader.close()
    cpu = _cpu_s() - cpu_before  # the epoch's workers are reaped when it ends
    print(json.dumps({"samples": samples, "bytes": nbytes, "wall": wall, "cpu": cpu, "ring": ring}))
    return 0


def _run(kind: str, paths: list[str]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "_epoch", kind, ",".join(paths)],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    if sys.argv[1:2] == ["_epoch"]:
        return _epoch_child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    load_before = common.loadavg()
    results: dict[str, list[dict[str, float]]] = {"single": [], "mix": []}
    with tempfile.TemporaryDirectory(dir=args.workdir) as root:
        both = os.path.join(root, "src-both")
        _write_files(os.path.join(root, "src-a"), "a", args.samples // 2, args.size)
        _write_files(os.path.join(root, "src-b"), "b", args.samples // 2, args.size)
        _write_files(both, "a", args.samples // 2, args.size)
        _write_files(both, "b", args.samples // 2, args.size)
        single = [_pack(both, os.path.join(root, "single"))]
        mix = [_pack(os.path.join(root, f"src-{s}"), os.path.join(root, s)) for s in "ab"]
        for rnd in range(args.rounds):
            order = [("single", single), ("mix", mix)]
            for kind, paths in order if rnd % 2 == 0 else order[::-1]:
                results[kind].append(_run(kind, paths))
                r = results[kind][-1]
                print(
                    f"[{rnd + 1}] {kind}: {r['samples'] / r['wall']:,.0f} samples/s",
                    file=sys.stderr,
                )
    rows, rate = [], {}
    for kind in ("single", "mix"):
        runs = results[kind]
        rate[kind] = common.median([r["samples"] / r["wall"] for r in runs])
        mbps = common.median([r["bytes"] / r["wall"] / 1e6 for r in runs])
        cpu_gb = common.median([r["cpu"] / (r["bytes"] / 1e9) for r in runs])
        name = "one dataset" if kind == "single" else "2-source mix (weights 1:1)"
        rows.append([name, f"{rate[kind]:,.0f}", f"{mbps:,.0f}", f"{cpu_gb:.1f}"])
    ratio = rate["mix"] / rate["single"]
    body = "\n".join(
        [
            f"Run {datetime.date.today().isoformat()}: `python benchmarks/bench_mix.py "
            f"--samples {args.samples} --size {args.size} --rounds {args.rounds}` "
            f"(load average before {load_before}, after {common.loadavg()}).",
            "",
            f"{args.samples:,} samples of {args.size:,} bytes, packed once as one dataset and "
            "once as two halves; each read through `ds.loader(batch_size=64, num_workers=2)` "
            "(the ring transport, checksums verified), warm, one epoch per child process, "
            f"{args.rounds} alternating rounds; medians. CPU: the child and its workers, "
            "user + system, per GB of verified payload.",
            "",
            common.markdown_table(["read", "samples/s", "MB/s", "CPU s / GB"], rows),
            "",
            f"The mix reads at {common.fmt_ratio(ratio)} the single dataset's rate, through the "
            "same loader class (`ShardLoader`), transport and workers.",
        ]
    )
    common.publish(body, SECTION, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
