"""Reading from a parallel filesystem: shardio and the peers on a private MooseFS bed.

The script starts its own bed (``scripts/pfs/moosefs.sh up``: a master, 2 chunkservers, one
copy of each chunk, a FUSE client mount), writes the same generated tree onto it as loose
files, shardio tar and hdf5 shards, an MDS copy (mosaic streaming) and a litdata copy, and
measures, each configuration in its own child process, cold (caches dropped after the
child's imports) and warm, median of ``--repeat`` rounds, round-robin:

- one epoch, bytes only, batch size 64, 2 DataLoader workers: loose files (shuffled),
  SPDL's thread pipeline over the loose files, webdataset, streaming's StreamingDataset,
  litdata's StreamingDataset, naive h5py, and shardio map and stream with the read strategy
  chosen automatically and with ``SHARDIO_READ_STRATEGY=local``; ``cat`` of the shards and of
  the loose files is the limit;
- metadata-server requests per 1,000 samples over two epochs of one process (the client's
  counters in ``MOUNT/.stats``, read before and after);
- ``shardio stage`` from the bed to local disk against ``cp -r`` (cold);
- an epoch of ``ShardDataset(recovery="skip")`` with one chunkserver stopped, against the
  same epoch healthy;
- ``--parts pinned`` (alone, with ``--bed-cpus`` and ``--reader-cpus``): the bed pinned to
  some CPUs and every child to the others, cold and warm, with the raw ceiling of map mode's
  reads and the CPU-seconds of the readers and of the bed (benchmarks/pfs_pinned.py).

The bed is always taken down (also on Ctrl-C or SIGTERM). The section "## On a parallel
filesystem (the MooseFS bed)" of benchmarks/RESULTS.md is rewritten (the pinned part: its own
section, "## On a parallel filesystem, pinned: ..."); other sections are kept.

Usage::

    sudo .venv/bin/python benchmarks/bench_pfs.py [--files 3000] [--repeat 3]
        [--only NAME,...] [--parts read,meta,stage,dead] [--no-write]
    sudo .venv/bin/python benchmarks/bench_pfs.py --parts pinned --bed-cpus 1 --reader-cpus 0

Not a test: it measures and reports, and asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import inspect
import json
import os
import pathlib
import random
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_pack
import bench_read
import common
import pfs_ceiling
import pfs_pinned

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ME = os.path.abspath(__file__)
VENV_BIN = os.path.dirname(sys.executable)
BED_SCRIPT = os.path.join(REPO, "scripts", "pfs", "moosefs.sh")
SECTION = "## On a parallel filesystem (the MooseFS bed)"
PEER_UNAVAILABLE = bench_read.PEER_UNAVAILABLE
SPDL_THREADS_ENV = "SHARDIO_BENCH_SPDL_THREADS"
STRATEGY_ENV = "SHARDIO_READ_STRATEGY"
COUNTERS = ("master.packets_sent", "fuse_ops.lookup.master", "fuse_ops.open")
PARTS = ("read", "meta", "stage", "dead", "pinned")
PINNED_DEFAULT = ("cat-shards", "ceiling", "shardio-map-auto", "shardio-stream-auto", "wds")

TARGET_STREAM_COLD_VS_CAT = 0.90
TARGET_MAP_COLD_VS_CAT = 0.70


# --------------------------------------------------------------------------------------------
# The children. Epoch children are bench_read's (``bench_read.py _child``), with two more
# readers registered here: litdata and SPDL. ``bench_pfs.py _child ...`` takes bench_read's
# arguments and prints/writes the same result.
# --------------------------------------------------------------------------------------------


def _prep_litdata(args: argparse.Namespace) -> Callable[[], bench_read.Batches]:
    try:
        from litdata import StreamingDataLoader, StreamingDataset
    except Exception as exc:  # any import failure means "unavailable"
        print(f"litdata unavailable: {exc!r}", file=sys.stderr)
        sys.exit(PEER_UNAVAILABLE)

    def start() -> bench_read.Batches:
        ds = StreamingDataset(input_dir=args.data, shuffle=False, seed=args.seed)
        loader = StreamingDataLoader(
            ds,
            batch_size=args.batch_size,
            num_workers=args.workers,
            collate_fn=_litdata_collate,
            **bench_read.keep_workers(args),
        )
        return loader, lambda b: b

    return start


def _litdata_collate(batch: list[dict[str, Any]]) -> list[bytes]:
    """litdata hands a bytes column out as memoryviews, which neither torch's default
    collate nor the worker-to-trainer pickling accepts: copy them, as the other peers do."""
    return [bytes(s["jpeg"]) for s in batch]


def _loose_files(root: str) -> list[str]:
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames))
    return files


def _prep_spdl(args: argparse.Namespace) -> Callable[[], bench_read.Batches]:
    try:
        from spdl.pipeline import PipelineBuilder
    except Exception as exc:
        print(f"spdl unavailable: {exc!r}", file=sys.stderr)
        sys.exit(PEER_UNAVAILABLE)
    threads = int(os.environ.get(SPDL_THREADS_ENV, "8"))

    def read(path: str) -> bytes:
        with open(path, "rb") as fh:
            return fh.read()

    def start() -> bench_read.Batches:
        files = _loose_files(args.data)  # the walk is part of the set-up, as for loose files
        random.Random(args.seed).shuffle(files)
        pipeline = (
            PipelineBuilder()
            .add_source(files)
            .pipe(read, concurrency=threads)
            .aggregate(args.batch_size)
            .add_sink(4)
            .build(num_threads=threads)
        )

        def batches() -> Iterable[Any]:
            with pipeline.auto_stop():
                yield from pipeline

        return batches(), lambda b: b

    return start


def _epoch_child(argv: Sequence[str]) -> int:
    if argv[:1] == ["ceiling"]:
        return pfs_ceiling.ceiling_child(argv[1:])
    bench_read._PREPS.setdefault("litdata", _prep_litdata)
    bench_read._PREPS.setdefault("spdl", _prep_spdl)
    result = argv[2] if len(argv) > 2 else ""  # NAME DATA RESULT ...
    return pfs_pinned.with_epoch_cpu(lambda: bench_read._child(argv), result)


def _litdata_sample(item: tuple[str, int]) -> dict[str, Any]:
    path, cls = item
    with open(path, "rb") as fh:
        return {"jpeg": fh.read(), "cls": cls}


def _write_litdata(argv: Sequence[str]) -> int:
    """``bench_pfs.py _write_litdata SRC DST BYTES``: litdata's ``optimize`` of the tree."""
    src, dst, shard_bytes = argv[0], argv[1], int(argv[2])
    try:
        from litdata import optimize
    except Exception as exc:
        print(f"litdata unavailable: {exc!r}", file=sys.stderr)
        return PEER_UNAVAILABLE
    rels, class_ids = bench_pack._walk_samples(src)
    inputs = [(os.path.join(src, r), class_ids[os.path.basename(os.path.dirname(r))]) for r in rels]
    optimize(
        fn=_litdata_sample, inputs=inputs, output_dir=dst, chunk_bytes=shard_bytes, num_workers=1
    )
    return 0


def _probe_child(argv: Sequence[str]) -> int:
    """``bench_pfs.py _probe DATA``: what this shardio offers (JSON on stdout)."""
    from shardio import ShardDataset
    from shardio.read.strategy import choose_strategy

    params = inspect.signature(ShardDataset.__init__).parameters
    out: dict[str, Any] = {
        "read_timeout_s": "read_timeout_s" in params,
        "read_strategy": "read_strategy" in params,
        "strategy_users": sorted(
            os.path.relpath(p, REPO)
            for p in glob.glob(os.path.join(REPO, "shardio", "**", "*.py"), recursive=True)
            if not p.endswith(os.path.join("read", "strategy.py"))
            and "choose_strategy(" in pathlib.Path(p).read_text(encoding="utf-8")
        ),
    }
    for requested in (None, "local"):
        choice = choose_strategy(argv[0], requested)
        out[f"strategy-{requested or 'auto'}"] = {
            "name": choice.strategy.name,
            "describe": choice.describe(),
            "reason": choice.reason,
        }
    print(json.dumps(out))
    return 0


def _dead_child(argv: Sequence[str]) -> int:
    """``bench_pfs.py _dead DATA RESULT``: one epoch of ShardDataset(recovery="skip"),
    writing its progress to RESULT after every batch (the parent may have to kill it)."""
    parser = argparse.ArgumentParser(prog="bench_pfs.py _dead")
    parser.add_argument("data")
    parser.add_argument("result")
    parser.add_argument("--mode", choices=("map", "stream"), default="map")
    parser.add_argument("--read-timeout-s", type=float, default=5.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--handshake", action="store_true")
    args = parser.parse_args(argv)
    import torch  # noqa: F401 - imported before the clock, as every user's script does

    from shardio import ShardDataset

    options: dict[str, Any] = {"mode": args.mode, "seed": args.seed}
    has_timeout = "read_timeout_s" in inspect.signature(ShardDataset.__init__).parameters
    if has_timeout:
        options["read_timeout_s"] = args.read_timeout_s
    if args.handshake:
        common.child_handshake()
    t0 = time.perf_counter()
    state: dict[str, Any] = {
        "samples": 0,
        "bytes": 0,
        "read_timeout_s": args.read_timeout_s if has_timeout else None,
        "done": False,
        "error": "",
    }

    def save() -> None:
        state["time_s"] = time.perf_counter() - t0
        tmp = args.result + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(state, fh)
        os.replace(tmp, args.result)

    ds: Any = None
    try:
        ds = ShardDataset(args.data, **options, recovery="skip")
        state["expected"] = len(ds)
        loader = ds.loader(batch_size=args.batch_size, num_workers=args.workers)
        for batch in loader:
            col = batch["jpeg"]
            for i in range(len(col)):
                state["samples"] += 1
                state["bytes"] += len(bytes(col[i]))
            state["recovery"] = dict(ds.recovery_stats)
            save()
        state["done"] = True
    except Exception as exc:  # reported, not raised: the parent tabulates it
        state["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if ds is not None:
        state["recovery"] = dict(getattr(ds, "recovery_stats", {}))
    save()
    return 0


# --------------------------------------------------------------------------------------------
# The bed.
# --------------------------------------------------------------------------------------------


class Bed:
    """A MooseFS bed of this run, started and stopped with scripts/pfs/moosefs.sh."""

    def __init__(self, root: str, *, chunkservers: int, ioretries: int, cpus: str = "") -> None:
        self.root = root
        self.mount = os.path.join(root, "mnt")
        self.chunkservers = chunkservers
        self.ioretries = ioretries
        self.up_argv = [
            "bash",
            BED_SCRIPT,
            "up",
            root,
            "--chunkservers",
            str(chunkservers),
            "--goal",
            "1",
            "--ioretries",
            str(ioretries),
            *(["--cpus", cpus] if cpus else []),
        ]

    def _script(self, *argv: str, timeout: float = 180.0) -> str:
        proc = subprocess.run(
            ["bash", BED_SCRIPT, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"moosefs.sh {argv[0]} failed (exit {proc.returncode}): "
                + " ".join(proc.stderr.strip().splitlines()[-2:])
            )
        return proc.stdout

    def up(self) -> None:
        proc = subprocess.run(
            self.up_argv, capture_output=True, text=True, timeout=600, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"moosefs.sh up failed: {proc.stderr.strip()[-500:]}")

    def down(self) -> None:
        self._script("down", self.root, timeout=300.0)

    def down_reported(self) -> str | None:
        """Take the bed down; a failure is printed and returned, not raised (the bed's script
        names what it left; the caller's figures stand)."""
        print("bed: down", file=sys.stderr)
        try:
            self.down()
        except Exception as exc:
            print(f"taking the bed down failed: {exc}", file=sys.stderr)
            return str(exc)
        return None

    def stop_chunkserver(self, i: int) -> None:
        self._script("stop-cs", self.root, str(i))

    def admin(self, *argv: str) -> str:
        return self._script("exec", self.root, *argv)

    def netns(self) -> str:
        """The bed's network namespace (``MFS_NETNS`` of DIR/bed.env)."""
        with open(os.path.join(self.root, "bed.env")) as fh:
            env = dict(line.rstrip("\n").split("=", 1) for line in fh if "=" in line)
        return env["MFS_NETNS"]

    def stats(self) -> dict[str, int]:
        """The client's counters (``MOUNT/.stats``), as tests/mfsbed.py's Bed.stats()."""
        counters: dict[str, int] = {}
        with open(os.path.join(self.mount, ".stats"), errors="replace") as fh:
            for line in fh:
                name, sep, value = line.partition(":")
                if sep and value.strip().lstrip("-").isdigit():
                    counters[name.strip()] = int(value.strip())
        return counters

    def chunkservers_of(self, paths: Sequence[str]) -> dict[str, set[int]]:
        """The chunkservers (1-based) that hold a copy of each file's chunks."""
        out = self.admin("mfsfileinfo", *paths)
        found: dict[str, set[int]] = {}
        current = ""
        for line in out.splitlines():
            if line and not line[0].isspace() and line.rstrip().endswith(":"):
                current = line.rstrip()[:-1]
                found.setdefault(current, set())
            elif line.strip().startswith("copy ") and current:
                port = int(line.split(":")[2].split()[0])
                found[current].add(port - 9421)
        return found


# --------------------------------------------------------------------------------------------
# Configurations.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One measured reader."""

    name: str
    label: str
    data: str  # tree | tar | hdf5 | mds | litdata: what it reads
    order: str
    child: str = ""  # epoch child name; "" for the cat rows
    strategy: str | None = None  # SHARDIO_READ_STRATEGY for the child (None: unset)


CONFIGS = [
    Config("cat-shards", "`cat` shardio tar shards > /dev/null (the limit)", "tar", "sequential"),
    Config("cat-loose", "`cat` every loose file > /dev/null", "tree", "sequential"),
    Config("loose", "loose files, open().read(), DataLoader", "tree", "random", "loose"),
    Config("spdl", "SPDL thread pipeline over loose files", "tree", "random", "spdl"),
    Config("wds", "webdataset `WebDataset` (shardio's tar shards)", "tar", "sequential", "wds"),
    Config("mds", "mosaic streaming `StreamingDataset` (MDS)", "mds", "sequential", "mds"),
    Config("litdata", "litdata `StreamingDataset`", "litdata", "sequential", "litdata"),
    Config("h5py", "naive h5py (shardio's hdf5 shards)", "hdf5", "random", "h5py"),
    Config("shardio-map-auto", "shardio map, strategy auto", "tar", "random", "shardio-map-tar"),
    Config(
        "shardio-map-local",
        "shardio map, `SHARDIO_READ_STRATEGY=local`",
        "tar",
        "random",
        "shardio-map-tar",
        "local",
    ),
    Config(
        "shardio-stream-auto",
        "shardio stream, strategy auto",
        "tar",
        "shard-local shuffle",
        "shardio-stream-tar",
    ),
    Config(
        "shardio-stream-local",
        "shardio stream, `SHARDIO_READ_STRATEGY=local`",
        "tar",
        "shard-local shuffle",
        "shardio-stream-tar",
        "local",
    ),
]
# The raw ceiling of map mode's reads (benchmarks/pfs_ceiling.py): for the pinned part.
CEILING = Config(
    "ceiling",
    "raw ceiling: `preadv` of every member in map mode's order, no checksum",
    "tar",
    "random (map's)",
    "ceiling",
)


@dataclass
class Outcome:
    """All runs of one reader."""

    config: Config
    times: dict[str, list[float | None]] = field(
        default_factory=lambda: {"cold": [], "warm": []}
    )  # per round, None when that run failed
    samples: int = 0
    nbytes: int = 0
    status: str = "ok"  # ok | failed | unavailable
    note: str = ""
    meta: dict[str, float] | None = None
    meta_note: str = ""

    def ok_times(self, cache: str) -> list[float]:
        return [t for t in self.times[cache] if t is not None]


def _env(strategy: str | None, spdl_threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(STRATEGY_ENV, None)
    if strategy is not None:
        env[STRATEGY_ENV] = strategy
    env[SPDL_THREADS_ENV] = str(spdl_threads)
    return env


def _shards(tar_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(tar_dir, "shards", "*.tar")))


def _cat_argv(cfg: Config, paths: dict[str, str]) -> list[str]:
    if cfg.name == "cat-shards":
        return ["cat", *_shards(paths["tar"])]
    return ["sh", "-c", 'find "$0" -type f -print0 | xargs -0 cat > /dev/null', paths["tree"]]


def _child_argv(cfg: Config, data: str, result: str, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        ME,
        "_child",
        cfg.child,
        data,
        result,
        "--batch-size",
        str(args.batch_size),
        "--workers",
        str(args.workers),
        "--seed",
        str(args.seed),
    ]


def _one_line(run: common.ChildRun) -> str:
    lines = [ln for ln in run.stderr_tail.strip().splitlines() if ln.strip()]
    why = "timed out" if run.timed_out else f"exit {run.returncode}"
    return f"{why}: {lines[-1].strip()[:200] if lines else '(no message)'}"


def _epoch(
    cfg: Config,
    paths: dict[str, str],
    args: argparse.Namespace,
    *,
    cold: bool,
    handshake: bool = True,
    epochs: int = 1,
) -> tuple[dict[str, Any] | None, common.ChildRun]:
    """``epochs`` epochs of ``cfg`` in one process (cold: caches dropped after its imports);
    (result, run)."""
    result_path = os.path.join(args.workdir, f"pfs-result-{cfg.name}.json")
    common.remove_path(result_path)
    argv = _child_argv(cfg, paths[cfg.data], result_path, args)
    if epochs > 1:
        argv += ["--epochs", str(epochs)]
    run = common.run_child(
        [*argv, "--handshake"] if handshake else argv,
        env=_env(cfg.strategy, args.spdl_threads),
        on_ready=(common.drop_caches if cold else (lambda: None)) if handshake else None,
        timeout_s=args.child_timeout,
    )
    result = None
    if run.returncode == 0 and os.path.exists(result_path):
        with open(result_path) as fh:
            result = json.load(fh)
    common.remove_path(result_path)
    return result, run


def _measure(
    outcome: Outcome,
    cache: str,
    paths: dict[str, str],
    args: argparse.Namespace,
    num_samples: int,
    payload: int,
) -> None:
    cfg = outcome.config
    if outcome.status != "ok":
        outcome.times[cache].append(None)
        return
    if cache == "warm":
        common.warm_up(paths[cfg.data])
    if not cfg.child:
        if cache == "cold":
            common.drop_caches()
        run = common.run_child(_cat_argv(cfg, paths), timeout_s=args.child_timeout)
        result = (
            {"samples": num_samples, "bytes": payload, "time_s": run.wall_s}
            if run.returncode == 0
            else None
        )
    else:
        result, run = _epoch(cfg, paths, args, cold=cache == "cold")
    if result is None:
        outcome.status = "unavailable" if run.returncode == PEER_UNAVAILABLE else "failed"
        outcome.note = _one_line(run)
        outcome.times[cache].append(None)
        print(f"[{cache}] {cfg.name:22s} {outcome.status}: {outcome.note}", file=sys.stderr)
        return
    outcome.times[cache].append(result["time_s"])
    outcome.samples, outcome.nbytes = result["samples"], result["bytes"]
    t = result["time_s"]
    print(
        f"[{cache}] {cfg.name:22s} {t:6.2f} s {result['samples'] / t:7.0f} samples/s "
        f"{result['bytes'] / 1e6 / t:6.0f} MB/s n={result['samples']} load {common.loadavg()}",
        file=sys.stderr,
    )


def _metadata(
    outcome: Outcome,
    bed: Bed,
    paths: dict[str, str],
    args: argparse.Namespace,
    num_samples: int,
) -> None:
    """Counters of the client per 1,000 samples over two epochs of one training process
    (as a job runs them), after a cache drop; ``cat`` runs twice."""
    cfg = outcome.config
    if outcome.status == "unavailable":
        outcome.meta_note = outcome.note
        return
    common.drop_caches()
    before = bed.stats()
    samples = 0
    for _ in range(1 if cfg.child else 2):
        if cfg.child:
            result, run = _epoch(cfg, paths, args, cold=False, handshake=False, epochs=2)
            if result is None:
                outcome.meta_note = _one_line(run)
                return
            samples += result["samples"]
        else:
            run = common.run_child(_cat_argv(cfg, paths), timeout_s=args.child_timeout)
            if run.returncode != 0:
                outcome.meta_note = _one_line(run)
                return
            samples += num_samples
    after = bed.stats()
    outcome.meta = {c: (after.get(c, 0) - before.get(c, 0)) * 1000 / samples for c in COUNTERS}
    print(
        f"[meta] {cfg.name:22s} "
        + "  ".join(f"{c}={v:.1f}" for c, v in outcome.meta.items())
        + " per 1,000 samples",
        file=sys.stderr,
    )


# --------------------------------------------------------------------------------------------
# Writing the datasets onto the bed.
# --------------------------------------------------------------------------------------------


def _prepare(
    tree: str, bed: Bed, args: argparse.Namespace, wanted: set[str]
) -> tuple[dict[str, str], dict[str, tuple[str, float | None, str]]]:
    """Write each dataset the selected readers need onto the mount; returns the paths and,
    per dataset, (command, seconds or None, error)."""
    base = os.path.join(bed.mount, "data")
    os.makedirs(base, exist_ok=True)
    paths = {k: os.path.join(base, k) for k in ("tree", "tar", "hdf5", "mds", "litdata")}
    shardio_bin = os.path.join(VENV_BIN, "shardio")

    def pack(fmt: str) -> list[str]:
        return [
            shardio_bin,
            "pack",
            tree,
            paths[fmt],
            "--format",
            fmt,
            "--shard-size",
            args.shard_size,
            "--no-progress",
        ]

    commands = {
        "tree": ["cp", "-r", tree, paths["tree"]],
        "tar": pack("tar"),
        "hdf5": pack("hdf5"),
        "mds": [
            sys.executable,
            os.path.join(os.path.dirname(ME), "bench_pack.py"),
            "_peer",
            "mds",
            tree,
            paths["mds"],
            str(args.shard_size_bytes),
        ],
        "litdata": [
            sys.executable,
            ME,
            "_write_litdata",
            tree,
            paths["litdata"],
            str(args.shard_size_bytes),
        ],
    }
    done: dict[str, tuple[str, float | None, str]] = {}
    for name, argv in commands.items():
        if name not in wanted:
            continue
        print("writing", _shell(argv), file=sys.stderr)
        run = common.run_child(argv, timeout_s=args.child_timeout)
        os.sync()
        error = "" if run.returncode == 0 else _one_line(run)
        done[name] = (_shell(argv), run.wall_s if not error else None, error)
        if error:
            print(f"  failed: {error}", file=sys.stderr)
    return paths, done


# --------------------------------------------------------------------------------------------
# Staging and the dead data server.
# --------------------------------------------------------------------------------------------


def _stage(paths: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    dest = os.path.join(args.workdir, "pfs-stage-dest")
    configs = [
        (
            "shardio-stage",
            "`shardio stage` (4 streams, every copy verified)",
            [os.path.join(VENV_BIN, "shardio"), "stage", paths["tar"], dest, "--no-progress"],
            paths["tar"],
        ),
        ("cp", "`cp -r` of the shard directory", ["cp", "-r", paths["tar"], dest], paths["tar"]),
        (
            "cp-loose",
            "`cp -r` of the loose files",
            ["cp", "-r", paths["tree"], dest],
            paths["tree"],
        ),
    ]
    walls: dict[str, list[float]] = {c[0]: [] for c in configs}
    notes: dict[str, str] = {}
    sizes = {c[0]: common.path_bytes(c[3]) for c in configs}
    for r in range(args.repeat):
        shift = r % len(configs)
        for name, _, argv, _ in configs[shift:] + configs[:shift]:
            if name in notes:
                continue
            common.remove_path(dest)
            common.drop_caches()
            common.back_free_memory(sizes[name])
            run = common.run_child(argv, timeout_s=args.child_timeout)
            if run.returncode != 0:
                notes[name] = _one_line(run)
                print(f"[stage] {name}: failed {notes[name]}", file=sys.stderr)
            else:
                walls[name].append(run.wall_s)
                print(
                    f"[stage] {name:14s} {run.wall_s:6.2f} s "
                    f"{sizes[name] / 1e6 / run.wall_s:6.0f} MB/s",
                    file=sys.stderr,
                )
    common.remove_path(dest)
    return {
        "configs": [(c[0], c[1], _shell(c[2])) for c in configs],
        "walls": walls,
        "notes": notes,
        "sizes": sizes,
    }


def _fatal_frames(stderr: str) -> str:
    """The innermost frames faulthandler printed for a fatal signal (where it happened)."""
    frames: list[str] = []
    collecting = False
    for raw in stderr.splitlines():
        line = raw.strip()
        if line.startswith("Current thread"):
            frames, collecting = [], True
        elif line.startswith("Thread 0x") or not line:
            collecting = False
        elif collecting and line.startswith('File "'):
            path, _, rest = line[len('File "') :].partition('"')
            where = os.path.relpath(path, REPO) if path.startswith(REPO) else path
            frames.append(where + rest.replace(", line ", ":").replace(" in ", " "))
    return "; ".join(frames[:3])


def _jpeg_members(shard: str) -> int:
    """Samples in a tar shard (its ``.jpeg`` members), read while its server is up."""
    with tarfile.open(shard, "r:") as tar:
        return sum(1 for m in tar if m.name.endswith(".jpeg"))


def _dead(bed: Bed, paths: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """A healthy epoch, then one chunkserver stopped and the same epoch, per mode.

    Placement is random, and with one copy a lost manifest or index makes the whole dataset
    unopenable (measured: a StorageError at open after the client's retries), which is
    another failure than the one measured here, lost shards. So the dataset's small files
    (everything beside shards/) get two copies (``mfssetgoal 2``, as a site keeps small
    critical files), the shards keep one, and chunkserver 1 is stopped.
    """
    shards = _shards(paths["tar"])
    shard_dir = os.path.join(paths["tar"], "shards") + os.sep
    files = sorted(os.path.join(root, f) for root, _, names in os.walk(paths["tar"]) for f in names)
    small = [f for f in files if not f.startswith(shard_dir)]
    bed.admin("mfssetgoal", "2", *small)
    deadline = time.monotonic() + args.replicate_timeout
    while True:
        held = bed.chunkservers_of(files)
        if all(len(held.get(f, set())) >= 2 for f in small) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    victim = 1
    lost = sorted(os.path.basename(s) for s in shards if held.get(s) == {victim})
    out: dict[str, Any] = {
        "victim": victim,
        "small_lost": sorted(
            os.path.relpath(f, paths["tar"]) for f in small if held.get(f) == {victim}
        ),
        "shards": len(shards),
        "lost_shards": lost,
        "lost_samples": sum(_jpeg_members(s) for s in shards if held.get(s) == {victim}),
        "runs": {},
    }
    modes = args.dead_modes.split(",")

    def epoch(mode: str, phase: str) -> dict[str, Any]:
        result = os.path.join(args.workdir, f"pfs-dead-{mode}-{phase}.json")
        common.remove_path(result)
        argv = [
            sys.executable,
            ME,
            "_dead",
            paths["tar"],
            result,
            "--mode",
            mode,
            "--read-timeout-s",
            f"{args.read_timeout_s:g}",
            "--batch-size",
            str(args.batch_size),
            "--workers",
            str(args.workers),
            "--seed",
            str(args.seed),
            "--handshake",
        ]
        env = {**_env(None, args.spdl_threads), "PYTHONFAULTHANDLER": "1"}  # a signal: where
        run = common.run_child(
            argv, env=env, on_ready=common.drop_caches, timeout_s=args.dead_timeout
        )
        state: dict[str, Any] = {}
        if os.path.exists(result):
            with open(result) as fh:
                state = json.load(fh)
        common.remove_path(result)
        state["wall_s"] = run.wall_s
        state["timed_out"] = run.timed_out
        state["argv"] = _shell(argv)
        if run.returncode != 0 and not run.timed_out:
            state["error"] = state.get("error") or _one_line(run)
            if run.returncode < 0:
                state["error"] = f"killed by {signal.Signals(-run.returncode).name}"
                state["where"] = _fatal_frames(run.stderr_tail)
        with open(os.path.join(args.workdir, f"pfs-dead-{mode}-{phase}.stderr"), "w") as fh:
            fh.write(run.stderr_tail)
        print(
            f"[dead] {mode}-{phase}: {state.get('samples', 0)} samples in "
            f"{state.get('time_s', run.wall_s):.1f} s, timed_out={run.timed_out} "
            f"recovery={state.get('recovery')} error={state.get('error', '')!r}",
            file=sys.stderr,
        )
        return state

    for mode in modes:
        out["runs"][f"{mode}-healthy"] = epoch(mode, "healthy")
    bed.stop_chunkserver(victim)
    time.sleep(2.0)  # the master notices the disconnection
    for i, mode in enumerate(modes):
        if i:
            # A stalled shard is held unavailable node-wide for a while (shardio's registry in
            # /dev/shm, shared by every process reading the dataset): let the holds of the
            # previous epoch expire so that each epoch pays for the dead server itself.
            time.sleep(args.dead_gap)
        out["runs"][f"{mode}-dead"] = epoch(mode, "dead")
    return out


# --------------------------------------------------------------------------------------------
# The report.
# --------------------------------------------------------------------------------------------


def _shell(argv: Sequence[str]) -> str:
    return shlex.join(a.replace(REPO + os.sep, "") for a in argv)


def _ratio_to(outcome: Outcome, ref: Outcome | None, cache: str) -> float | None:
    """Median over rounds of ref's time / this reader's time, same round."""
    if ref is None:
        return None
    pairs = [
        r / t
        for r, t in zip(ref.times[cache], outcome.times[cache], strict=False)
        if r is not None and t is not None
    ]
    return common.median(pairs) if pairs else None


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _fmt(value: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _verdict(value: float | None, target: float) -> str:
    if value is None:
        return "n/a"
    return "PASS" if value >= target else "FAIL"


def _report(
    args: argparse.Namespace,
    outcomes: list[Outcome],
    prep: dict[str, tuple[str, float | None, str]],
    probe: dict[str, Any],
    stage: dict[str, Any] | None,
    dead: dict[str, Any] | None,
    facts: dict[str, Any],
) -> str:
    by = {o.config.name: o for o in outcomes}
    cat = by.get("cat-shards")
    cat_loose = by.get("cat-loose")
    lines: list[str] = []
    lines.append(
        f"{facts['files']:,} files of ~{args.mean_kb:g} KB ({facts['payload'] / 1e6:.0f} MB "
        f"of JPEG payload, {args.classes} classes; `scripts/gen_imagenet.py`), written onto a "
        f"private MooseFS bed this script starts (`{_shell(facts['bed_argv'])}`; "
        f"{facts['mfs_version']}): a master, {args.chunkservers} chunkservers and a FUSE "
        f"client on this one machine, one copy of each chunk (goal 1), chunk 64 MiB, the "
        f"chunkservers' disks on `{facts['bed_fs']}`; servers in a private network namespace, "
        f"so the 'network' is the loopback. Shards of {args.shard_size} ({facts['shards']} tar "
        f"shards, {facts['shard_bytes'] / 1e6:.0f} MB). Batch size {args.batch_size}, "
        f"{args.workers} DataLoader workers, bytes only (no decoding); the training process "
        "reads one byte per page of each sample (bench_read's `--touch`)."
    )
    lines.append("")
    lines.append(
        f"Read strategy on the bed: auto → **{probe['strategy-auto']['name']}** "
        f"({probe['strategy-auto']['reason']}); forced → "
        f"{probe['strategy-local']['name']}. `ShardDataset(read_strategy=)` "
        + ("exists" if probe["read_strategy"] else "is not in this tree yet")
        + "; the read path "
        + (
            f"calls `choose_strategy` ({', '.join(probe['strategy_users'])})"
            if probe["strategy_users"]
            else "**does not call `choose_strategy` yet: auto and local run the same code**"
        )
        + "; `ShardDataset(read_timeout_s=)` "
        + ("exists." if probe["read_timeout_s"] else "is **not available** in this tree.")
    )
    lines.append("")

    if prep:
        rows = [
            [name, _fmt(sec, ".1f"), err or "ok", f"`{cmd}`"]
            for name, (cmd, sec, err) in prep.items()
        ]
        lines += [
            "### Writing the datasets onto the bed (one run each, from the local tree)",
            "",
            common.markdown_table(["dataset", "s", "status", "command"], rows),
            "",
        ]

    if any(o.times["cold"] or o.times["warm"] for o in outcomes):
        lines += [
            f"### One epoch from the mount (median of {args.repeat} rounds; MB/s of JPEG payload)",
            "",
        ]
        rows = []
        for o in outcomes:
            row = [o.config.label, o.config.order]
            for cache in ("cold", "warm"):
                ts = o.ok_times(cache)
                t = common.median(ts) if ts else None
                row += [
                    _fmt(facts["files"] / t if t else None),
                    _fmt(facts["payload"] / 1e6 / t if t else None),
                    _fmt(_ratio_to(o, cat, cache), ".2f", "x"),
                ]
            if o.status != "ok":
                row.append(f"{o.status}: {o.note}")
            else:
                row.append(
                    "; ".join(
                        f"{c} " + ", ".join(f"{t:.2f}" for t in o.ok_times(c))
                        for c in ("cold", "warm")
                    )
                )
            rows.append(row)
        header = [
            "reader",
            "order",
            "cold samples/s",
            "cold MB/s",
            "cold vs cat",
            "warm samples/s",
            "warm MB/s",
            "warm vs cat",
            "times s (or why not)",
        ]
        lines += [common.markdown_table(header, rows), ""]
        lines.append(
            '"vs cat": in each round, the time of `cat` of the tar shards over the reader\'s '
            "time, median over rounds. Times are set-up plus the epoch, imports excluded "
            "(bench_read's children); `cat` is the process wall time."
        )
        if cat_loose is not None and cat is not None:
            r = _ratio_to(cat_loose, cat, "cold")
            lines.append(
                f"`cat` of the loose files reaches {_fmt(r, '.2f', 'x')} of `cat` of the "
                "shards cold: the cost of one file per sample on this filesystem."
            )
        lines.append("")
        for name, target, what in (
            ("shardio-stream-auto", TARGET_STREAM_COLD_VS_CAT, "stream"),
            ("shardio-map-auto", TARGET_MAP_COLD_VS_CAT, "map"),
        ):
            o = by.get(name)
            v = _ratio_to(o, cat, "cold") if o else None
            lines.append(
                f"- Target: shardio {what}, cold, strategy auto ≥ {target:.2f}x `cat`: "
                f"{_fmt(v, '.2f', 'x')} → **{_verdict(v, target)}**"
            )
        lines.append("")

    metas = [o for o in outcomes if o.meta is not None or o.meta_note]
    if metas:
        lines += ["### Metadata-server requests per 1,000 samples over two epochs", ""]
        rows = []
        for o in metas:
            if o.meta is None:
                rows.append([o.config.label, "-", "-", "-", o.meta_note])
            else:
                rows.append([o.config.label] + [f"{o.meta[c]:,.1f}" for c in COUNTERS] + [""])
        lines += [
            common.markdown_table(
                [
                    "reader",
                    "`master.packets_sent`",
                    "`fuse_ops.lookup.master`",
                    "`fuse_ops.open`",
                    "note",
                ],
                rows,
            ),
            "",
            "The client's counters in `MOUNT/.stats`, read before and after two epochs of one "
            "process (as a training job runs them: the loader iterated twice, `set_epoch` "
            "between where it has one; `cat` twice), caches dropped before the first, over the "
            "samples delivered. `master.packets_sent` is every request the client sent to the "
            "metadata server (lookups, opens, attribute fetches, chunk locations...).",
        ]
        wds, sio = by.get("wds"), by.get("shardio-map-auto")
        sio_stream = by.get("shardio-stream-auto")
        if wds and wds.meta:
            for o in (sio, sio_stream):
                if o and o.meta:
                    v = o.meta["master.packets_sent"]
                    ok = v <= wds.meta["master.packets_sent"]
                    lines.append(
                        f"- Target: {o.config.label} ≤ webdataset's `master.packets_sent`: "
                        f"{v:.1f} vs {wds.meta['master.packets_sent']:.1f} → "
                        f"**{'PASS' if ok else 'FAIL'}**"
                    )
        lines.append("")

    if stage:
        lines += ["### Staging from the bed to local disk (cold)", ""]
        rows = []
        cp = stage["walls"].get("cp") or []
        for name, label, _ in stage["configs"]:
            ws = stage["walls"][name]
            t = common.median(ws) if ws else None
            rows.append(
                [
                    label,
                    _fmt(stage["sizes"][name] / 1e6, ".0f"),
                    _fmt(t, ".2f"),
                    _fmt(stage["sizes"][name] / 1e6 / t if t else None),
                    _fmt(common.median(cp) / t if t and cp else None, ".2f", "x"),
                    stage["notes"].get(name, ", ".join(f"{w:.2f}" for w in ws)),
                ]
            )
        lines += [
            common.markdown_table(
                ["copy", "MB", "median s", "MB/s", "throughput vs `cp -r` shards", "times s"],
                rows,
            ),
            "",
            "Destination: "
            f"`{facts['workdir_fs']}` under `--workdir`; caches dropped and the memory "
            "the copy fills touched (common.back_free_memory) before each run.",
            "",
        ]

    if dead:
        lines += ["### An epoch with a dead data server", ""]
        lines.append(
            f"Chunkserver {dead.get('victim', 1)} of {args.chunkservers} stopped (`moosefs.sh "
            f"stop-cs DIR {dead.get('victim', 1)}`; the dataset's small files beside "
            "`shards/` (manifest, index) given two copies first, `mfssetgoal 2`, since a lost "
            "manifest is another failure: the dataset cannot be opened at all"
            + (
                f"; **not replicated in time, lost: {', '.join(dead['small_lost'])}**"
                if dead.get("small_lost")
                else ""
            )
            + f"), one copy of each chunk: {len(dead['lost_shards'])} of {dead['shards']} "
            "shards have "
            f"their only copy there"
            + (
                f" ({dead['lost_samples']:,} samples)"
                if dead.get("lost_samples") is not None
                else ""
            )
            + f". Client mounted with `mfsioretries={args.ioretries}` (a read "
            "of a lost chunk fails with ENXIO after the retries; 10-20 s measured here with 3). "
            f"`ShardDataset(DATA, mode=M, seed=0"
            + (f", read_timeout_s={args.read_timeout_s:g}" if probe["read_timeout_s"] else "")
            + ', recovery="skip").loader(batch_size=64, num_workers=2)`, cold; '
            + (
                ""
                if probe["read_timeout_s"]
                else "`read_timeout_s` **not available** in this tree (not passed); "
            )
            + f"each epoch killed after {args.dead_timeout:g} s."
        )
        lines.append("")
        rows = []
        for key, st in dead["runs"].items():
            mode, phase = key.split("-", 1)
            t = st.get("time_s")
            outcome = (
                f"killed after {args.dead_timeout:g} s"
                if st.get("timed_out")
                else (_short(st.get("error", "")) or ("complete" if st.get("done") else "?"))
            )
            if st.get("where"):
                outcome += f" (in {st['where']})"
            rec = st.get("recovery") or {}
            rows.append(
                [
                    mode,
                    phase,
                    _fmt(t, ".1f"),
                    f"{st.get('samples', 0):,}",
                    f"{st.get('expected', 0):,}" if st.get("expected") else "-",
                    str(rec.get("skip", 0)),
                    ", ".join(f"{k} {v}" for k, v in sorted(rec.items()) if v) or "-",
                    outcome,
                ]
            )
        lines += [
            common.markdown_table(
                [
                    "mode",
                    "data servers",
                    "epoch s",
                    "samples delivered",
                    "epoch length",
                    "substituted",
                    "recovery events",
                    "outcome",
                ],
                rows,
            ),
            "",
        ]
        for mode in args.dead_modes.split(","):
            h, d = dead["runs"].get(f"{mode}-healthy"), dead["runs"].get(f"{mode}-dead")
            if h and d and h.get("time_s") and d.get("time_s"):
                if d.get("done"):
                    lost = (d.get("recovery") or {}).get("skip", 0)
                    lines.append(
                        f"- {mode}: the dead server costs {d['time_s'] - h['time_s']:+.1f} s "
                        f"({d['time_s'] / h['time_s']:.1f}x the healthy epoch); {lost} samples "
                        "substituted."
                    )
                else:
                    lines.append(
                        f"- {mode}: the epoch **did not finish**: it ended after "
                        f"{d['time_s']:.1f} s with {d.get('samples', 0)} of "
                        f"{d.get('expected', '?')} samples delivered (healthy epoch "
                        f"{h['time_s']:.1f} s). Full error: {d.get('error') or 'killed'}"[:900]
                    )
        lines.append("")

    lines += [
        "### How it was run",
        "",
        f"`{_shell(facts['argv'])}` (as root: the bed and `drop_caches` need it). "
        f"Started {facts['started']}, {facts['elapsed_s'] / 60:.1f} min. Load average before: "
        f"{facts['load_before']}, after: {facts['load_after']}. Cold: "
        + ("caches dropped" if facts["cold_ok"] else "**not root: caches NOT dropped**")
        + " (`sync; echo 3 > /proc/sys/vm/drop_caches`) after each child's imports (the "
        "READY/GO handshake of bench_read), which also empties the chunkservers' page cache "
        "(their chunk files are on this machine's disk: compare `cat`'s cold and warm rows). "
        "The client's own read-ahead buffers (`mfsreadaheadsize`, 256 MiB in all by default) "
        "are outside the page cache; whether they keep data from one process to the next is "
        "not checked here. Warm: every file the reader reads read once just before, so warm "
        "`cat` reads the page cache while the readers, with 2 workers on a loaded machine, "
        "are CPU-bound: the warm ratios measure CPU, not the filesystem.",
        "",
        "Epoch children: `" + _shell([sys.executable, ME]) + " _child NAME DATA RESULT "
        f"--batch-size {args.batch_size} --workers {args.workers} --seed {args.seed} "
        "--handshake` (bench_read's children, plus `litdata`: "
        "`StreamingDataset(input_dir=DATA, shuffle=False)` + `StreamingDataLoader`, and "
        "`spdl`: `PipelineBuilder().add_source(shuffled paths).pipe(read, "
        f"concurrency={args.spdl_threads}).aggregate({args.batch_size}).add_sink(4)"
        f".build(num_threads={args.spdl_threads})`); mosaic streaming reads with "
        "`local=DATA, remote=None`; `cat`: `cat DATA/tar/shards/*.tar > /dev/null` and "
        "`find DATA/tree -type f -print0 | xargs -0 cat > /dev/null`.",
        "",
        f"Versions: {facts['versions']}.",
        "",
        common.code_line(facts["code_before"], facts["code_after"], "read"),
        "",
        "Machine notes: "
        + f"{os.cpu_count()} CPUs shared with other work during this run (on the run of "
        + "record: three other helpers running tests on the same 2 cores), so the figures "
        "are noisy and CPU-bound readers (DataLoader workers, decoding of the sample "
        "tables) are slowed the most; compare ratios within a round rather than absolute "
        "figures. The bed runs on the same machine: the client, the master and both "
        "chunkservers share those CPUs with the readers, and every byte crosses the loopback "
        "and FUSE, not a real network: latencies are lower and CPU costs higher than on a "
        "Lustre or GPFS cluster.",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The pinned part (benchmarks/pfs_pinned.py measures and reports).
# --------------------------------------------------------------------------------------------


def _pinned_configs(parser: argparse.ArgumentParser, only: str) -> list[Config]:
    """The pinned part's readers: ``--only`` (of CONFIGS and the ceiling) or the default
    set, always with `cat` of the shards and the ceiling, the two references."""
    pool = [*CONFIGS, CEILING]
    if only:
        chosen = {c.name for c in common.select_named(parser, only, pool)}
    else:
        chosen = set(PINNED_DEFAULT)
    chosen |= {"cat-shards", "ceiling"}
    return [c for c in pool if c.name in chosen]


def _check_cpus(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--bed-cpus and --reader-cpus: both with --parts pinned (alone), online, disjoint."""
    pinned = "pinned" in args.parts_set
    if pinned and len(args.parts_set) > 1:
        parser.error("--parts pinned runs alone (its bed is pinned): give it without the others")
    given = [n for n in ("bed_cpus", "reader_cpus") if getattr(args, n) is not None]
    if not pinned:
        if given:
            parser.error(f"--{given[0].replace('_', '-')} is for --parts pinned only")
        return
    online = pfs_pinned.online_cpus()
    sets: dict[str, set[int]] = {}
    for name in ("bed_cpus", "reader_cpus"):
        option = "--" + name.replace("_", "-")
        text = getattr(args, name)
        if text is None:
            parser.error(f"--parts pinned needs {option} (a CPU list such as 0 or 0-1)")
        try:
            sets[name] = pfs_pinned.parse_cpu_list(text, online)
        except ValueError as exc:
            parser.error(f"{option} takes a list of online CPUs ({sorted(online)}): {exc}")
    both = sets["bed_cpus"] & sets["reader_cpus"]
    if both:
        parser.error(
            f"--bed-cpus {args.bed_cpus} and --reader-cpus {args.reader_cpus} overlap on CPU "
            f"{min(both)}: the bed and the readers must run on separate CPUs"
        )


def _pinned(
    bed: Bed,
    paths: dict[str, str],
    args: argparse.Namespace,
    outcomes: list[Outcome],
    num_samples: int,
    payload: int,
) -> dict[str, Any]:
    readers = []
    for o in outcomes:
        cfg = o.config
        result = os.path.join(args.workdir, f"pfs-pinned-{cfg.name}.json") if cfg.child else ""
        argv = (
            [*_child_argv(cfg, paths[cfg.data], result, args), "--handshake"]
            if cfg.child
            else _cat_argv(cfg, paths)
        )
        env = {**_env(cfg.strategy, args.spdl_threads), "SHARDIO_PIN_WORKERS": "0"}
        readers.append(
            pfs_pinned.Reader(cfg.name, cfg.label, cfg.order, argv, paths[cfg.data], result, env)
        )
    daemons = pfs_pinned.bed_pids(bed.netns())
    allowed = {pid: pfs_pinned.allowed_lists(pid) for pid in daemons}
    print("bed pinning:", {f"{c} {p}": allowed[p] for p, c in daemons.items()}, file=sys.stderr)
    tallies, loads = pfs_pinned.measure(
        readers,
        rounds=args.repeat,
        reader_cpus=args.reader_cpus,
        bed=daemons,
        timeout_s=args.child_timeout,
        num_samples=num_samples,
        payload=payload,
        peer_unavailable=PEER_UNAVAILABLE,
    )
    for pid in daemons:  # as they were at the end, too (a thread started later included)
        allowed[pid] |= pfs_pinned.allowed_lists(pid)
    for line in pfs_pinned.verdicts(tallies):
        print(line.replace("**", ""), file=sys.stderr)
    return {"tallies": tallies, "loads": loads, "bed_pids": daemons, "bed_allowed": allowed}


# --------------------------------------------------------------------------------------------
# Main.
# --------------------------------------------------------------------------------------------


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the PFS benchmark and update RESULTS.md."""
    argv = list(sys.argv[1:] if argv is None else argv)
    children = {
        "_child": _epoch_child,
        "_write_litdata": _write_litdata,
        "_probe": _probe_child,
        "_dead": _dead_child,
    }
    if argv[:1] and argv[0] in children:
        return children[argv[0]](argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--mean-kb", type=float, default=110.0)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3, help="rounds (each: cold, then warm)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size", default="32MiB", help="shard size of every writer")
    parser.add_argument("--spdl-threads", type=int, default=8)
    parser.add_argument("--chunkservers", type=int, default=2)
    parser.add_argument(
        "--ioretries", type=int, default=3, help="the client's mfsioretries (bounds dead reads)"
    )
    parser.add_argument("--read-timeout-s", type=float, default=5.0)
    parser.add_argument("--dead-modes", default="map,stream")
    parser.add_argument(
        "--dead-timeout", type=float, default=180.0, help="kill a dead-server epoch after this"
    )
    parser.add_argument(
        "--replicate-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the second copy of the manifest and index",
    )
    parser.add_argument(
        "--dead-gap",
        type=float,
        default=65.0,
        help="seconds between two dead-server epochs (shardio's node-wide holds expire)",
    )
    parser.add_argument(
        "--child-timeout", type=float, default=600.0, help="kill any other child after this"
    )
    parser.add_argument(
        "--parts",
        default=",".join(p for p in PARTS if p != "pinned"),
        help="read,meta,stage,dead; or pinned, alone",
    )
    parser.add_argument(
        "--bed-cpus", default=None, help="pinned: the bed's CPUs (moosefs.sh up --cpus)"
    )
    parser.add_argument(
        "--reader-cpus", default=None, help="pinned: the readers' and cat's CPUs (taskset)"
    )
    parser.add_argument("--only", default="", help="comma-separated reader names")
    parser.add_argument("--bed-dir", default="", help="new or empty (default: /tmp/...)")
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--regen", action="store_true", help="regenerate the local tree")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(",")) if args.parts else set()
    if parts - set(PARTS):
        parser.error(f"unknown --parts {sorted(parts - set(PARTS))}; known: {', '.join(PARTS)}")
    args.parts_set = parts
    _check_cpus(parser, args)
    if args.repeat < 1 or args.files < 1 or args.chunkservers < 2:
        parser.error("--repeat and --files must be at least 1, --chunkservers at least 2")
    args.shard_size_bytes = bench_read._parse_size(args.shard_size)
    if os.geteuid() != 0:
        parser.error("needs root: the MooseFS bed (network namespace, FUSE) and drop_caches")
    pinned_part = "pinned" in parts
    configs = (
        _pinned_configs(parser, args.only)
        if pinned_part
        else common.select_named(parser, args.only, CONFIGS)
    )
    args.workdir = os.path.abspath(args.workdir)
    common.hold_bench_lock(args.workdir)
    signal.signal(signal.SIGTERM, _sigterm)

    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t_start = time.perf_counter()
    load_before = common.loadavg()
    code_before = common.code_state(REPO)
    tree = common.ensure_tree(
        REPO, args.workdir, files=args.files, classes=args.classes, mean_kb=args.mean_kb,
        regen=args.regen,
    )  # fmt: skip
    num_samples, payload = common.tree_payload(tree)
    bed_dir = args.bed_dir or f"/tmp/shardio-bench-pfs-{os.getpid()}"
    bed = Bed(
        bed_dir,
        chunkservers=args.chunkservers,
        ioretries=args.ioretries,
        cpus=args.bed_cpus if pinned_part else "",
    )

    wanted = {c.data for c in configs} | {"tar"}
    if "stage" in parts:
        wanted |= {"tree"}
    outcomes = [Outcome(c) for c in configs]
    prep: dict[str, tuple[str, float | None, str]] = {}
    stage = dead = None
    probe: dict[str, Any] = {}
    facts: dict[str, Any] = {}
    pinned: dict[str, Any] = {}
    try:
        print("bed:", _shell(bed.up_argv), file=sys.stderr)
        bed.up()
        paths, prep = _prepare(tree, bed, args, wanted)
        if prep["tar"][2]:
            raise SystemExit(f"packing onto the bed failed: {prep['tar'][2]}")
        for o in outcomes:
            err = prep.get(o.config.data, ("", 0.0, ""))[2]
            if err:
                o.status, o.note = "failed", f"writing its data failed: {err}"
        probe_run = subprocess.run(
            [sys.executable, ME, "_probe", paths["tar"]],
            capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        probe = json.loads(probe_run.stdout.strip().splitlines()[-1])
        print("probe:", probe, file=sys.stderr)
        facts["mfs_version"] = "MooseFS " + common.first_line(
            ["dpkg-query", "-W", "-f", "${Version}\\n", "moosefs-client"]
        )
        if "read" in parts:
            for r in range(args.repeat):
                shift = r % len(outcomes)
                order = outcomes[shift:] + outcomes[:shift]
                for cache in ("cold", "warm"):
                    for o in order:
                        _measure(o, cache, paths, args, num_samples, payload)
        if "meta" in parts:
            for o in outcomes:
                _metadata(o, bed, paths, args, num_samples)
        if "stage" in parts:
            stage = _stage(paths, args)
        if "dead" in parts:
            dead = _dead(bed, paths, args)  # last: it breaks the bed
        if pinned_part:
            pinned = _pinned(bed, paths, args, outcomes, num_samples, payload)
        shards = _shards(paths["tar"])
        facts.update(
            shards=len(shards),
            shard_bytes=sum(os.path.getsize(s) for s in shards),
            bed_fs=common.first_line(["stat", "-f", "-c", "%T", bed_dir]),
        )
    finally:
        bed.down_reported()

    facts.update(
        files=num_samples,
        payload=payload,
        bed_argv=bed.up_argv,
        workdir_fs=common.first_line(["stat", "-f", "-c", "%T", args.workdir]),
        argv=[sys.executable, ME, *argv],
        started=started,
        elapsed_s=time.perf_counter() - t_start,
        load_before=load_before,
        load_after=common.loadavg(),
        cold_ok=True,
        code_before=code_before,
        code_after=common.code_state(REPO),
        versions=", ".join(
            f"{p} {common.package_version(p)}"
            for p in ("torch", "webdataset", "mosaicml-streaming", "litdata", "spdl", "h5py")
        ),
    )
    if pinned_part:
        section, body = pfs_pinned.SECTION, _pinned_report(args, pinned, facts)
    else:
        section, body = SECTION, _report(args, outcomes, prep, probe, stage, dead, facts)
    print(body)
    if not args.no_write:
        common.update_section(args.out, section, body, common.results_header(args.workdir))
        print(f"wrote {section!r} into {args.out}", file=sys.stderr)
    return 0


def _pinned_report(args: argparse.Namespace, pinned: dict[str, Any], facts: dict[str, Any]) -> str:
    return pfs_pinned.report(
        pinned["tallies"],
        pinned["loads"],
        {
            **facts,
            **pinned,
            "mean_kb": args.mean_kb,
            "bed_argv": _shell(facts["bed_argv"]),
            "argv": _shell(facts["argv"]),
            "bed_cpus": args.bed_cpus,
            "reader_cpus": args.reader_cpus,
            "batch_size": args.batch_size,
            "workers": args.workers,
            "rounds": args.repeat,
            "child_cmd": _shell([sys.executable, ME])
            + f" _child NAME DATA RESULT --batch-size {args.batch_size} --workers "
            f"{args.workers} --seed {args.seed} --handshake",
            "code_line": common.code_line(facts["code_before"], facts["code_after"], "read"),
        },
    )


if __name__ == "__main__":
    sys.exit(main())
