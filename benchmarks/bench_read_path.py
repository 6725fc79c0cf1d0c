"""Read path per filesystem: the ``local`` and ``pfs`` read strategies against ``cat``.

One ImageNet-like tree (scripts/gen_imagenet.py) is packed twice: onto the local disk and
onto a MooseFS test bed (``scripts/pfs/moosefs.sh``, a real parallel filesystem: a master,
chunkservers and a FUSE client). On each, every configuration (mode map|stream, 0|2
DataLoader workers, read strategy local|pfs) reads one cold epoch (caches dropped after the
dataset is opened, before the first batch) and then one warm epoch (the next epoch's order,
the same bytes), bytes only, batch size 64, in a child process of its own. ``cat`` of the same
shards to /dev/null, cold then warm, is the limit, measured in the same round; each figure
is a ratio to that round's ``cat`` and the table shows medians over ``--runs`` rounds (the
machine is shared: absolute rates drift, ratios to a neighbouring ``cat`` much less). The bed
is started in ``--workdir`` and taken down at the end (``--bed DIR`` reuses a running one).

The client's metadata requests (``master.packets_sent`` in MOUNT/.stats) per 1,000 samples
of the cold epoch are reported too: the read strategy must not add any.

Usage::

    .venv/bin/python benchmarks/bench_read_path.py [--files 4000] [--runs 3]
        [--shard-size 48MiB] [--only local,bed] [--bed DIR] [--no-write]

Not a test: it measures and reports, and asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from common import (  # noqa: E402
    drop_caches,
    markdown_table,
    median,
    results_header,
    update_section,
)

HEADING = "## Read path per filesystem"
WHY = """Why. `local` reads each member with one `pread` in the reading thread: on a local disk
the kernel's readahead and the device queue make that as fast as the disk, and it stays the
choice there (`auto` picks it; its code path is unchanged). On the bed every request is a
round trip through the FUSE client to a chunkserver: members read one at a time in shuffled
order are latency-bound, while the same shards read sequentially with one request in flight
stream nearly as fast as `cat` (requests split between threads or processes were slower on
this client). `pfs` therefore reads, in stream mode, each shard of the epoch's windows ahead
sequentially in 8 MiB requests (one thread per reader; each of the loader's workers reads
every shard whole, the page cache holding one copy; bounded by `stream_readahead_bytes`, and
at least the next whole window, of shards not yet begun) and waits for it before each batch,
so the members (still read and checked one by one, in the epoch's unchanged order) come from
the page cache; in map mode it reads each batch with 16 requests in flight on I/O threads (4
per worker with 2 workers; neighbours within 256 KiB coalesced) and hashes each member on the
reading thread once it is in the batch buffer. Map mode's random reads stay bound by the
client's and chunkservers' cost per request (a chunkserver reads and CRC-checks whole 64 KiB
blocks: a ~110 KB member at a random offset costs 2 to 3 of them). Workers of
`ShardLoader` read under the deadline (`read_timeout_s`, 120 s by default on a network
filesystem) without a thread hop (watched reads); a process reading by itself
(`num_workers=0`) hops to an I/O thread per call, which the rows with `read_timeout_s=0`
price."""
MODES = ("stream", "map")
WORKERS = (0, 2)
STRATEGIES = ("local", "pfs")
CHILD_TIMEOUT_S = 600.0


@dataclass(frozen=True, kw_only=True)
class Config:
    fs: str
    mode: str
    workers: int
    strategy: str
    tuning: str = ""  # JSON of ReadStrategy fields replaced in "pfs" (a tuning run)
    timeout: float | None = None  # read_timeout_s (None: its default)

    @property
    def label(self) -> str:
        """The strategy column: the strategy, a tuning, a read timeout other than default."""
        tuned = f" {self.tuning}" if self.tuning else ""
        timed = "" if self.timeout is None else f", read_timeout_s={self.timeout:g}"
        return f"{self.strategy}{tuned}{timed}"

    @property
    def name(self) -> str:
        return f"{self.fs} {self.mode} w{self.workers} {self.label}"


def _stats(mount: str | None) -> dict[str, int]:
    """The FUSE client's counters (MooseFS: MOUNT/.stats), empty elsewhere."""
    if mount is None:
        return {}
    out: dict[str, int] = {}
    try:
        with open(os.path.join(mount, ".stats"), errors="replace") as fh:
            text = fh.read()
    except OSError:
        return {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and value.strip().lstrip("-").isdigit():
            out[name.strip()] = int(value.strip())
    return out


def _child(argv: Sequence[str]) -> int:
    """One configuration: a cold epoch, then a warm one; prints one JSON line."""
    root, mode, workers, strategy, mount = argv[0], argv[1], int(argv[2]), argv[3], argv[4]
    timeout = float(argv[5]) if argv[5] != "-" else None
    from shardio.read import strategy as strategies
    from shardio.runtime.dataset import ShardDataset

    if argv[6] != "-":  # a tuning run: the pfs strategy with other values
        tuned = dataclasses.replace(strategies.PFS, **json.loads(argv[6]))
        strategies.STRATEGIES["pfs"] = tuned

    extra: dict[str, Any] = {} if timeout is None else {"read_timeout_s": timeout}
    ds = ShardDataset(root, mode=mode, read_strategy=strategy, seed=7, **extra)
    loader = ds.loader(batch_size=64, num_workers=workers)
    out: dict[str, Any] = {"strategy": ds.read_choice.describe()}
    for epoch, cache in ((0, "cold"), (1, "warm")):
        ds.set_epoch(epoch)
        if cache == "cold" and not drop_caches():
            out["warm_only"] = True
        before = _stats(mount if mount != "-" else None)
        began = time.perf_counter()
        samples = nbytes = 0
        for batch in loader:
            samples += len(batch["__key__"])
            nbytes += sum(
                int(v.offsets[-1] - v.offsets[0]) for v in batch.values() if hasattr(v, "offsets")
            )
        took = time.perf_counter() - began
        after = _stats(mount if mount != "-" else None)
        sent = after.get("master.packets_sent", 0) - before.get("master.packets_sent", 0)
        out[cache] = {"s": took, "bytes": nbytes, "samples": samples, "master_packets": sent}
    counts = loader.metrics().counters
    out["opens"] = int(counts.get("opens_source", 0)) + int(counts.get("opens_staged", 0))
    print(json.dumps(out), flush=True)
    return 0


def _cat(paths: Sequence[str]) -> tuple[float, float]:
    """Seconds of ``cat`` of ``paths`` to /dev/null: cold, then warm."""
    out = []
    for cold in (True, False):
        if cold:
            drop_caches()
        began = time.perf_counter()
        subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True, timeout=600)
        out.append(time.perf_counter() - began)
    return out[0], out[1]


def _shard_paths(root: str) -> list[str]:
    with open(os.path.join(root, "manifest.json")) as fh:
        manifest = json.load(fh)
    return [os.path.join(root, s["path"]) for s in manifest["shards"]]


def _ensure_data(args: argparse.Namespace, roots: dict[str, str]) -> None:
    src = os.path.join(args.workdir, "src")
    if not os.path.isdir(src):
        subprocess.run(
            [sys.executable, os.path.join(REPO, "scripts", "gen_imagenet.py"), "--files",
             str(args.files), "--splits", "train", "--quiet", src],
            check=True, timeout=1800,
        )  # fmt: skip
    for root in roots.values():
        if not os.path.exists(os.path.join(root, "manifest.json")):
            subprocess.run(
                [sys.executable, "-m", "shardio", "pack", os.path.join(src, "train"), root,
                 "--shard-size", args.shard_size, "--workers", "2"],
                check=True, timeout=1800,
            )  # fmt: skip


def _run_child(cfg: Config, root: str, mount: str | None) -> dict[str, Any] | None:
    timeout = cfg.timeout
    argv = [sys.executable, os.path.abspath(__file__), "--child", root, cfg.mode,
            str(cfg.workers), cfg.strategy, mount or "-",
            "-" if timeout is None else str(timeout), cfg.tuning or "-"]  # fmt: skip
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        print(f"  {cfg.name}: timed out", file=sys.stderr)
        return None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"  {cfg.name}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _bed_up(workdir: str) -> str:
    bed = os.path.join(workdir, "bed")
    subprocess.run(
        [os.path.join(REPO, "scripts", "pfs", "moosefs.sh"), "up", bed, "--chunkservers", "2"],
        check=True, timeout=300,
    )  # fmt: skip
    return bed


def _bed_down(bed: str) -> None:
    subprocess.run(
        [os.path.join(REPO, "scripts", "pfs", "moosefs.sh"), "down", bed], check=False, timeout=300
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/shardio-bench-readpath")
    parser.add_argument("--files", type=int, default=4000)
    parser.add_argument("--shard-size", default="48MiB")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", default="local,bed", help="filesystems: local,bed")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--workers", default=",".join(map(str, WORKERS)))
    parser.add_argument("--bed", default=None, help="a running bed's DIR (else one is started)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument(
        "--read-timeouts",
        default="default",
        help="read_timeout_s values, comma-separated ('default': the dataset's default)",
    )
    parser.add_argument(
        "--tune", action="append", default=[],
        help='also "pfs" with these ReadStrategy fields, as JSON: {"inflight": 8}',
    )  # fmt: skip
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    fss = [f for f in args.only.split(",") if f]
    bed = args.bed
    started = False
    if "bed" in fss and bed is None:
        bed = _bed_up(args.workdir)
        started = True
    try:
        roots = {"local": os.path.join(args.workdir, "local")}
        mounts: dict[str, str | None] = {"local": None}
        if "bed" in fss:
            assert bed is not None
            roots["bed"] = os.path.join(bed, "mnt", "readpath-ds")
            mounts["bed"] = os.path.join(bed, "mnt")
        roots = {k: v for k, v in roots.items() if k in fss}
        _ensure_data(args, roots)
        timeouts = [None if t == "default" else float(t) for t in args.read_timeouts.split(",")]
        configs = [
            Config(fs=fs, mode=m, workers=w, strategy=s, timeout=t)
            for fs in fss
            for m in args.modes.split(",")
            for w in (int(x) for x in args.workers.split(","))
            for t in timeouts
            for s in args.strategies.split(",")
            if fs == "bed" or t is None  # a local disk has no deadline by default: 0 is that
        ] + [
            Config(fs=fs, mode=m, workers=w, strategy="pfs", tuning=tune, timeout=t)
            for fs in fss
            for m in args.modes.split(",")
            for w in (int(x) for x in args.workers.split(","))
            for t in timeouts
            for tune in args.tune
        ]
        cats: dict[str, list[tuple[float, float]]] = {fs: [] for fs in fss}
        results: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}
        nbytes = {fs: sum(os.path.getsize(p) for p in _shard_paths(roots[fs])) for fs in fss}
        for _run in range(args.runs):
            for fs in fss:
                for cfg in (c for c in configs if c.fs == fs):
                    # cat next to each configuration: the machine's load drifts.
                    cold, warm = _cat(_shard_paths(roots[fs]))
                    cats[fs].append((cold, warm))
                    got = _run_child(cfg, roots[fs], mounts[fs])
                    if got is None:
                        continue
                    got["cat"] = {"cold": cold, "warm": warm}
                    results[cfg.name].append(got)
                    print(f"  {cfg.name}: cold {got['cold']['bytes'] / got['cold']['s'] / 1e6:.0f}"
                          f" MB/s ({cold / got['cold']['s']:.2f}x cat), warm "
                          f"{got['warm']['bytes'] / got['warm']['s'] / 1e6:.0f} MB/s "
                          f"({warm / got['warm']['s']:.2f}x cat)", flush=True)  # fmt: skip
        with open(os.path.join(args.workdir, "results.json"), "w") as fh:
            json.dump({"cats": cats, "results": results, "nbytes": nbytes}, fh)
        body = _report(args, configs, cats, results, nbytes)
        print(body)
        if not args.no_write:
            update_section(
                os.path.join(HERE, "RESULTS.md"), HEADING, body, results_header(args.workdir)
            )
    finally:
        if started and bed is not None:
            _bed_down(bed)
    return 0


def _report(
    args: argparse.Namespace,
    configs: Sequence[Config],
    cats: dict[str, list[tuple[float, float]]],
    results: dict[str, list[dict[str, Any]]],
    nbytes: dict[str, int],
) -> str:
    rows = []
    cold_ratio: dict[tuple[str, str, int, float | None, str], float] = {}
    for cfg in configs:
        got = results[cfg.name]
        if not got:
            rows.append([cfg.fs, cfg.mode, str(cfg.workers), cfg.label, "failed",
                         "", "", "", ""])  # fmt: skip
            continue
        ratio = {
            cache: median([r["cat"][cache] * r[cache]["bytes"] / nbytes[cfg.fs] / r[cache]["s"]
                           for r in got])
            for cache in ("cold", "warm")
        }  # fmt: skip
        rate = {c: median([r[c]["bytes"] / r[c]["s"] / 1e6 for r in got]) for c in ("cold", "warm")}
        if not cfg.tuning:
            cold_ratio[(cfg.fs, cfg.mode, cfg.workers, cfg.timeout, cfg.strategy)] = ratio["cold"]
        per_k = median(
            [1000 * r["cold"]["master_packets"] / max(r["cold"]["samples"], 1) for r in got]
        )
        rows.append([
            cfg.fs, cfg.mode, str(cfg.workers), cfg.label,
            f"{rate['cold']:.0f}", f"{ratio['cold']:.2f}x",
            f"{rate['warm']:.0f}", f"{ratio['warm']:.2f}x",
            f"{per_k:.0f}" if cfg.fs == "bed" else "-",
        ])  # fmt: skip
    cat_rows = [
        [fs, f"{median([nbytes[fs] / c / 1e6 for c, _ in cats[fs]]):.0f}",
         f"{median([nbytes[fs] / w / 1e6 for _, w in cats[fs]]):.0f}",
         f"{nbytes[fs] / 1e6:.0f} MB"]
        for fs in cats
    ]  # fmt: skip
    command = "sudo .venv/bin/python benchmarks/bench_read_path.py " + shlex.join(
        [
            f"--files={args.files}",
            f"--runs={args.runs}",
            f"--shard-size={args.shard_size}",
            f"--read-timeouts={args.read_timeouts}",
        ]
    )
    return "\n".join(
        [
            f"`{command}` (medians of {args.runs} rounds; each ratio is to `cat` of the same "
            "shards in the same round, cold to cold, warm to warm; bytes only, batch 64, ring "
            "transport, the default read timeout unless the strategy column names one). "
            "Cold: `sync; echo 3 > /proc/sys/vm/drop_caches`"
            " after the dataset is opened, before the first batch. bed: MooseFS test bed "
            "(`scripts/pfs/moosefs.sh up DIR --chunkservers 2`: master, 2 chunkservers, FUSE "
            "client, one copy per chunk), local: the same dataset on the local disk.",
            "",
            markdown_table(["fs", "cat cold MB/s", "cat warm MB/s", "shards"], cat_rows),
            "",
            *_winners(cold_ratio),
            "",
            WHY,
            "",
            "",
            markdown_table(
                [
                    "fs",
                    "mode",
                    "workers",
                    "strategy",
                    "cold MB/s",
                    "cold / cat",
                    "warm MB/s",
                    "warm / cat",
                    "master requests / 1k samples (cold)",
                ],
                rows,
            ),
        ]
    )


def _winners(cold_ratio: dict[tuple[str, str, int, float | None, str], float]) -> list[str]:
    """One line per (fs, mode, workers, timeout): the strategy with the higher cold ratio."""
    lines = ["Cold epoch, which strategy wins (median ratio to `cat`):", ""]
    keys = sorted(
        {k[:4] for k in cold_ratio},
        key=lambda k: (k[0], k[1], k[2], -1.0 if k[3] is None else k[3]),
    )
    for fs, mode, workers, timeout in keys:
        local = cold_ratio.get((fs, mode, workers, timeout, "local"))
        pfs = cold_ratio.get((fs, mode, workers, timeout, "pfs"))
        if local is None or pfs is None:
            continue
        timed = "" if timeout is None else f", read_timeout_s={timeout:g}"
        best = "pfs" if pfs > local else "local"
        lines.append(
            f"- {fs} {mode}, {workers} workers{timed}: **{best}** "
            f"(pfs {pfs:.2f}x, local {local:.2f}x)"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
