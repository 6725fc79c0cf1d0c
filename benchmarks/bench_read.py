"""Read throughput: ShardDataset against loose files and the peers' readers, on one tree.

The ImageNet-like tree of bench_pack.py is packed once (``shardio pack --format tar|hdf5``,
and an MDS copy with streaming's MDSWriter); then every configuration reads one epoch of it,
bytes only (no decoding), batch size 64, through a PyTorch DataLoader with 2 workers (DALI's
reader, the in-process anchor, with 2 threads), each configuration in its own child process,
warm and cold cache, median of ``--repeat-warm``/``--repeat-cold`` runs, round-robin. The raw
limit is ``cat`` of the shards to /dev/null. A separate, untimed pass under strace counts
opens and stats per 1,000 samples beyond start-up. The section "## Read throughput" of
benchmarks/RESULTS.md is rewritten; other sections are kept.

Usage::

    .venv/bin/python benchmarks/bench_read.py [--files 20000] [--repeat-warm 3]
        [--repeat-cold 2] [--only NAME,...] [--no-write]

Not a test: it measures and reports, and asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import glob
import json
import math
import os
import re
import resource
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)
ME = os.path.abspath(__file__)
SECTION = "## Read throughput"
PEER_UNAVAILABLE = 3  # exit code of a child whose library cannot be imported
STRACE = "strace"
TRACED = "openat,open,stat,newfstatat,statx,lstat"
PAGE = 4096

TARGET_STREAM_COLD_VS_CAT = 0.90
TARGET_WARM_VS_WDS = 2.0
TARGET_WARM_VS_MDS = 1.5
TARGET_WARM_VS_DALI = 0.5
TARGET_MAP_COLD_VS_LOOSE = 2.0
TARGET_OPENS_PER_1000 = 5.0


# --------------------------------------------------------------------------------------------
# Configurations.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One measured configuration."""

    name: str
    label: str
    data: str  # tar | hdf5 | mds | tree: the files it reads
    order: str  # what the reader is asked for
    raw: bool = False  # ``cat`` of the shards (no child script)
    raw_ref: str = "cat-tar"  # the raw limit it is compared with


CONFIGS = [
    Config("cat-tar", "`cat` tar shards > /dev/null (raw limit)", "tar", "sequential", raw=True),
    Config(
        "cat-hdf5",
        "`cat` hdf5 shards > /dev/null (raw limit)",
        "hdf5",
        "sequential",
        raw=True,
        raw_ref="cat-hdf5",
    ),
    Config("shardio-stream-tar", "shardio stream, tar", "tar", "shard-local shuffle"),
    Config(
        "shardio-stream-hdf5",
        "shardio stream, hdf5",
        "hdf5",
        "shard-local shuffle",
        raw_ref="cat-hdf5",
    ),
    Config("shardio-stream-tar-seq", "shardio stream, tar, shuffle=False", "tar", "sequential"),
    Config("shardio-map-tar", "shardio map, tar", "tar", "random"),
    Config("shardio-map-hdf5", "shardio map, hdf5", "hdf5", "random", raw_ref="cat-hdf5"),
    Config("loose", "loose files, open().read() per file", "tree", "random"),
    Config("wds", "webdataset `WebDataset` (tar shards)", "tar", "sequential"),
    Config("mds", "streaming `StreamingDataset` (MDS copy)", "mds", "sequential"),
    Config("h5py", "naive h5py (hdf5 shards)", "hdf5", "random", raw_ref="cat-hdf5"),
    Config("dali", "DALI `fn.readers.webdataset` (CPU, in-process)", "tar", "sequential"),
]


# --------------------------------------------------------------------------------------------
# The children: ``bench_read.py _child NAME DATA_DIR RESULT_JSON [--limit N] [--handshake]``.
# Each ``_prep_*`` imports what it needs (not timed) and returns a ``start`` callable that
# builds the dataset and loader (timed as set-up) and returns (batches, samples_of) where
# ``samples_of(batch)`` gives the batch's JPEG payloads, one bytes-like object per sample
# (bytes, or a view: shardio's mapped columns and DALI's tensors expose the buffer protocol).
# --------------------------------------------------------------------------------------------

Batches = tuple[Iterable[Any], Callable[[Any], tuple[int, int]]]


def keep_workers(args: argparse.Namespace) -> dict[str, Any]:
    """A peer's DataLoader keyword arguments for a run of several epochs: its workers are
    kept between them (``persistent_workers``), as shardio's loader keeps its own; mosaic
    streaming's second epoch through the same DataLoader hangs without it."""
    return {"persistent_workers": True} if args.workers > 0 and args.epochs > 1 else {}


def _prep_shardio(
    mode: str, shuffle: bool, *, threads: bool = False
) -> Callable[[argparse.Namespace], Batches]:
    def prep(args: argparse.Namespace) -> Callable[[], Batches]:
        from shardio import ShardDataset
        from shardio.runtime.loader import ShardLoader  # noqa: F401 - imported before the clock

        def start() -> Batches:
            ds = ShardDataset(args.data, mode=mode, shuffle=shuffle, seed=args.seed)
            # Only when asked: a baseline commit's loader may not know the argument.
            more = {"threads": True} if threads else {}
            loader = ds.loader(batch_size=args.batch_size, num_workers=args.workers, **more)

            def samples_of(batch: Any) -> list[Any]:
                col = batch["jpeg"]
                return [col[i] for i in range(len(col))]

            return loader, samples_of

        return start

    return prep  # type: ignore[return-value]


def _prep_loose(args: argparse.Namespace) -> Callable[[], Batches]:
    import torch
    from torch.utils.data import DataLoader, Dataset

    class LooseFiles(Dataset):  # type: ignore[type-arg]
        """What torchvision's ImageFolder does, minus decoding: walk the tree once (scandir,
        no per-file stat), then open().read() each file by index."""

        def __init__(self, root: str) -> None:
            self.files: list[tuple[str, str]] = []
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                cls = os.path.basename(dirpath)
                self.files.extend((os.path.join(dirpath, f), cls) for f in sorted(filenames))
            self.classes = {c: i for i, c in enumerate(sorted({c for _, c in self.files}))}

        def __len__(self) -> int:
            return len(self.files)

        def __getitem__(self, i: int) -> dict[str, Any]:
            path, cls = self.files[i]
            with open(path, "rb") as fh:
                data = fh.read()
            return {"jpeg": data, "cls": self.classes[cls]}

    def start() -> Batches:
        loader = DataLoader(
            LooseFiles(args.data),
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.workers,
            generator=torch.Generator().manual_seed(args.seed),
            **keep_workers(args),
        )
        return loader, lambda b: b["jpeg"]

    return start


def _prep_wds(args: argparse.Namespace) -> Callable[[], Batches]:
    try:
        import webdataset as wds
    except ImportError as exc:
        print(f"webdataset unavailable: {exc}", file=sys.stderr)
        sys.exit(PEER_UNAVAILABLE)
    from torch.utils.data import DataLoader

    def start() -> Batches:
        urls = sorted(glob.glob(os.path.join(args.data, "shards", "*.tar")))
        ds = (
            wds.WebDataset(urls, shardshuffle=False, empty_check=False)
            .to_tuple("jpeg", "cls")
            .batched(args.batch_size)
        )
        loader = DataLoader(ds, batch_size=None, num_workers=args.workers, **keep_workers(args))
        return loader, lambda b: b[0]

    return start


def _prep_mds(args: argparse.Namespace) -> Callable[[], Batches]:
    try:
        common.import_streaming()
        from streaming.base.dataset import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory
    except Exception as exc:  # any import failure means "unavailable"
        print(f"mosaicml-streaming unavailable: {exc!r}", file=sys.stderr)
        sys.exit(PEER_UNAVAILABLE)
    from torch.utils.data import DataLoader

    clean_stale_shared_memory()

    def start() -> Batches:
        ds = StreamingDataset(
            local=args.data, remote=None, shuffle=False, batch_size=args.batch_size
        )
        loader = DataLoader(
            ds, batch_size=args.batch_size, num_workers=args.workers, **keep_workers(args)
        )
        return loader, lambda b: b["jpeg"]

    return start


def _prep_h5py(args: argparse.Namespace) -> Callable[[], Batches]:
    import h5py
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Dataset

    class NaiveH5(Dataset):  # type: ignore[type-arg]
        """Map-style dataset over shardio's HDF5 shards as a user of plain h5py writes it:
        the member tables are read once in the main process (files closed before the fork),
        each worker opens the shards lazily and reads ``f['data'][off:off+size]``."""

        def __init__(self, root: str) -> None:
            self.paths = sorted(glob.glob(os.path.join(root, "shards", "*.h5")))
            shard, offset, size, label = [], [], [], []
            for s, path in enumerate(self.paths):
                with h5py.File(path, "r") as f:
                    first = f["sample_first_member"][:].astype(np.int64)
                    count = f["sample_num_members"][:].astype(np.int64)
                    ext = f["member_ext"][:]
                    off = f["member_offset"][:].astype(np.int64)
                    siz = f["member_size"][:].astype(np.int64)
                    lab = f["sample_label"][:].astype(np.int64)
                jpeg = np.array([e in (b"jpeg", "jpeg") for e in ext])
                for i in range(len(first)):
                    rows = np.arange(first[i], first[i] + count[i])
                    m = int(rows[jpeg[rows]][0])
                    shard.append(s)
                    offset.append(int(off[m]))
                    size.append(int(siz[m]))
                    label.append(int(lab[i]))
            self.shard, self.offset = np.array(shard), np.array(offset)
            self.size, self.label = np.array(size), np.array(label)
            self.files: dict[int, Any] = {}

        def __len__(self) -> int:
            return len(self.shard)

        def __getitem__(self, i: int) -> dict[str, Any]:
            s = int(self.shard[i])
            f = self.files.get(s)
            if f is None:
                f = self.files[s] = h5py.File(self.paths[s], "r")
            off, size = int(self.offset[i]), int(self.size[i])
            return {"jpeg": f["data"][off : off + size].tobytes(), "cls": int(self.label[i])}

    def start() -> Batches:
        loader = DataLoader(
            NaiveH5(args.data),
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.workers,
            generator=torch.Generator().manual_seed(args.seed),
            **keep_workers(args),
        )
        return loader, lambda b: b["jpeg"]

    return start


def _prep_dali(args: argparse.Namespace) -> Callable[[], Batches]:
    try:
        from nvidia.dali import fn, pipeline_def
    except Exception as exc:
        print(f"DALI unavailable: {exc!r}", file=sys.stderr)
        sys.exit(PEER_UNAVAILABLE)

    def start() -> Batches:
        tars = sorted(glob.glob(os.path.join(args.data, "shards", "*.tar")))
        idxs = [t[: -len(".tar")] + ".idx" for t in tars]

        @pipeline_def(batch_size=args.batch_size, num_threads=args.workers, device_id=None)
        def pipe() -> Any:
            jpeg, cls = fn.readers.webdataset(
                paths=tars,
                index_paths=idxs,
                ext=["jpeg", "cls"],
                random_shuffle=False,
                pad_last_batch=True,
                name="reader",
            )
            return jpeg, cls

        p = pipe()
        p.build()
        epoch = p.epoch_size("reader")

        def batches() -> Iterable[Any]:
            left = epoch
            for _ in range(math.ceil(epoch / args.batch_size)):
                jpeg, _ = p.run()
                n = min(left, args.batch_size)
                left -= n
                yield [jpeg[i] for i in range(n)]  # TensorCPU: buffer protocol, no copy

        return batches(), lambda b: b

    return start


_PREPS: dict[str, Callable[[argparse.Namespace], Callable[[], Batches]]] = {
    "shardio-stream-tar": _prep_shardio("stream", True),
    "shardio-stream-hdf5": _prep_shardio("stream", True),
    "shardio-stream-tar-seq": _prep_shardio("stream", False),
    "shardio-map-tar": _prep_shardio("map", True),
    "shardio-map-tar-threads": _prep_shardio("map", True, threads=True),
    "shardio-stream-tar-threads": _prep_shardio("stream", True, threads=True),
    "shardio-map-hdf5": _prep_shardio("map", True),
    "loose": _prep_loose,
    "wds": _prep_wds,
    "mds": _prep_mds,
    "h5py": _prep_h5py,
    "dali": _prep_dali,
}


def _child(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_read.py _child")
    parser.add_argument("name", choices=sorted(_PREPS))
    parser.add_argument("data")
    parser.add_argument("result")
    parser.add_argument("--limit", type=int, default=0, help="stop after this many samples")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--handshake", action="store_true")
    parser.add_argument("--no-touch", dest="touch", action="store_false")
    parser.add_argument(
        "--epochs",
        type=int,
        default=1,
        help="epochs in this process (a loader is iterated again, set_epoch first where it "
        "has one; a one-shot pipeline is built again)",
    )
    args = parser.parse_args(argv)
    start = _PREPS[args.name](args)  # imports: not timed
    import torch  # noqa: F401 - every configuration but DALI uses it; import before the clock

    if args.handshake:
        common.child_handshake()  # the parent drops the caches here for a cold run
    # What the imports left on the heap is frozen: the collection that reaps the workers at
    # the end (and any full one on the way) then walks what the run made, not all of torch.
    gc.collect()
    gc.freeze()
    cpu0 = _cpu_now()
    t0 = time.perf_counter()
    batches, samples_of = start()
    t_setup = time.perf_counter()
    samples = nbytes = touched = 0
    t_first: float | None = None
    for epoch in range(max(1, args.epochs)):
        if epoch:
            if iter(batches) is batches:  # a one-shot generator: build the pipeline again
                batches, samples_of = start()
            elif hasattr(batches, "set_epoch"):
                batches.set_epoch(epoch)
        for batch in batches:
            for payload in samples_of(batch):
                view = memoryview(payload).cast("B")
                samples += 1
                nbytes += view.nbytes
                if args.touch:
                    touched += sum(view[::PAGE])  # one byte per page: reaches this process
            if t_first is None:
                t_first = time.perf_counter()
            if args.limit and samples >= args.limit:
                break
    t_end = time.perf_counter()
    # Tear the loader down and reap its workers (persistent ones too: a ShardLoader stops
    # them when collected), so that their CPU time reaches RUSAGE_CHILDREN.
    del batches, samples_of, start
    gc.collect()
    live = common.child_pids(os.getpid())  # e.g. multiprocessing's resource tracker
    cpu1 = _cpu_now()
    import pfs_pinned

    live_cpu_s = sum(pfs_pinned.tree_cpu_s(pid) for pid in live)  # their whole life
    shardio_module = getattr(sys.modules.get("shardio"), "__file__", None)
    with open(args.result, "w") as fh:
        json.dump(
            {
                "samples": samples,
                "bytes": nbytes,
                "setup_s": t_setup - t0,
                "first_batch_s": (t_first or t_end) - t0,
                "time_s": t_end - t0,
                "teardown_s": time.perf_counter() - t_end,
                "cpu_user_s": cpu1[0] - cpu0[0],
                "cpu_sys_s": cpu1[1] - cpu0[1],
                "live_children": len(live),  # not reaped: their CPU is not in the above
                "live_children_cpu_s": live_cpu_s,
                "shardio_module": shardio_module,
            },
            fh,
        )
    return 0


def _cpu_now() -> tuple[float, float]:
    """(user, system) CPU-seconds of this process (all its threads) and of the children it
    has reaped (DataLoader workers once joined), from ``getrusage``."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + kids.ru_utime, own.ru_stime + kids.ru_stime


# --------------------------------------------------------------------------------------------
# Preparing the data: the tree, its shardio tar and hdf5 packs, an MDS copy.
# --------------------------------------------------------------------------------------------


def _ensure_data(args: argparse.Namespace, src: str) -> dict[str, str]:
    base = os.path.join(
        args.workdir,
        f"read-f{args.files}-kb{args.mean_kb:g}-c{args.classes}-s{args.shard_size}",
    )
    os.makedirs(base, exist_ok=True)
    paths = {"tree": src}
    for name in ("tar", "hdf5", "mds"):
        dst = os.path.join(base, name)
        paths[name] = dst
        stamp = dst + ".done"
        if os.path.exists(stamp) and not args.regen:
            continue
        common.remove_path(dst)
        common.remove_path(stamp)
        if name == "mds":
            argv = [
                sys.executable,
                os.path.join(os.path.dirname(ME), "bench_pack.py"),
                "_peer",
                "mds",
                src,
                dst,
                str(args.shard_size_bytes),
            ]
        else:
            argv = [
                os.path.join(VENV_BIN, "shardio"),
                "pack",
                src,
                dst,
                "--format",
                name,
                "--shard-size",
                args.shard_size,
                "--no-progress",
            ]
        print("preparing", _shell(argv), file=sys.stderr)
        run = common.run_child(argv)
        if run.returncode != 0:
            if name == "mds":
                print(
                    f"MDS copy failed (streaming row skipped): {run.stderr_tail}", file=sys.stderr
                )
                common.remove_path(dst)
                continue
            raise SystemExit(f"preparing {name} failed:\n{run.stderr_tail}")
        with open(stamp, "w") as fh:
            fh.write(_shell(argv) + "\n")
    return paths


def _shard_files(data_dir: str, fmt: str) -> list[str]:
    return sorted(
        glob.glob(os.path.join(data_dir, "shards", "*." + ("tar" if fmt == "tar" else "h5")))
    )


# --------------------------------------------------------------------------------------------
# Measuring.
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One timed run."""

    time_s: float  # cat: process wall; python: set-up + reading, imports excluded
    wall_s: float  # spawn to reap
    samples: int
    nbytes: int
    first_batch_s: float
    max_rss: int
    tree_rss: int


@dataclass
class Outcome:
    """All runs of one configuration."""

    config: Config
    warm: list[Run] = field(default_factory=list)
    cold: list[Run] = field(default_factory=list)
    status: str = "ok"  # ok | failed | unavailable
    note: str = ""
    syscalls: dict[str, Any] | None = None

    def runs(self, cache: str) -> list[Run]:
        return self.warm if cache == "warm" else self.cold

    def time(self, cache: str) -> float | None:
        runs = self.runs(cache)
        return common.median([r.time_s for r in runs]) if runs else None


def _child_argv(
    cfg: Config, data: str, result: str, limit: int, args: argparse.Namespace
) -> list[str]:
    argv = [sys.executable, ME, "_child", cfg.name, data, result]
    if limit:
        argv += ["--limit", str(limit)]
    return [
        *argv,
        "--batch-size",
        str(args.batch_size),
        "--workers",
        str(args.workers),
        "--seed",
        str(args.seed),
        *([] if args.touch else ["--no-touch"]),
    ]


def _cat_argv(cfg: Config, paths: dict[str, str]) -> list[str]:
    return ["cat", *_shard_files(paths[cfg.data], cfg.data)]  # stdout: /dev/null


def _cat_shell(cfg: Config) -> str:
    ext = "tar" if cfg.data == "tar" else "h5"
    return f"cat DATA/shards/*.{ext} > /dev/null"


def _measure_one(
    outcome: Outcome,
    cache: str,
    paths: dict[str, str],
    args: argparse.Namespace,
    num_samples: int,
    payload: int,
    cold_ok: list[bool],
) -> None:
    cfg = outcome.config
    data = paths[cfg.data]
    if cache == "warm":
        common.warm_up(data)

    def drop() -> None:
        cold_ok[0] = common.drop_caches() and cold_ok[0]

    if cfg.raw:
        if cache == "cold":
            drop()
        run = common.run_child(_cat_argv(cfg, paths))
        result = {
            "samples": num_samples,
            "bytes": payload,
            "time_s": run.wall_s,
            "first_batch_s": 0.0,
        }
    else:
        result_path = os.path.join(args.workdir, f"read-result-{cfg.name}.json")
        common.remove_path(result_path)
        argv = [*_child_argv(cfg, data, result_path, 0, args), "--handshake"]
        run = common.run_child(argv, on_ready=drop if cache == "cold" else (lambda: None))
        result = {}
        if run.returncode == 0 and os.path.exists(result_path):
            with open(result_path) as fh:
                result = json.load(fh)
        common.remove_path(result_path)
    if run.returncode == PEER_UNAVAILABLE and not cfg.raw:
        outcome.status = "unavailable"
        outcome.note = (run.stderr_tail.strip().splitlines() or ["?"])[-1]
    elif run.returncode != 0 or not result:
        outcome.status = "failed"
        outcome.note = f"exit {run.returncode}: " + " ".join(
            run.stderr_tail.strip().splitlines()[-2:]
        )
    else:
        outcome.runs(cache).append(
            Run(
                time_s=result["time_s"],
                wall_s=run.wall_s,
                samples=result["samples"],
                nbytes=result["bytes"],
                first_batch_s=result["first_batch_s"],
                max_rss=run.max_rss_bytes,
                tree_rss=run.peak_tree_rss_bytes,
            )
        )
    got = outcome.runs(cache)[-1] if outcome.status == "ok" else None
    print(
        f"[{cache}] {cfg.name:24s} "
        + (
            f"{got.time_s:6.2f} s  {got.samples / got.time_s:8.0f} samples/s  "
            f"{got.nbytes / 1e6 / got.time_s:6.0f} MB/s  n={got.samples}  "
            f"rss={got.max_rss / common.MiB:.0f} MiB  load {common.loadavg()}"
            if got
            else f"{outcome.status}: {outcome.note}"
        ),
        file=sys.stderr,
    )


_SYSCALL = re.compile(r"^\d+\s+(?P<name>\w+)\((?P<args>.*)$")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_FD_PATH = re.compile(r"^\d+<([^>]*)>")


def _count_syscalls(log: str, data_roots: Sequence[str]) -> dict[str, int]:
    """Traced calls in an ``strace -f -y`` log: total, and those naming a data file."""
    counts = {"total": 0, "data": 0, "shm": 0}
    with open(log, errors="replace") as fh:
        for line in fh:
            m = _SYSCALL.match(line)
            if not m:
                continue  # "<... resumed>" halves, signals, exits
            counts["total"] += 1
            args = m.group("args")
            found = _QUOTED.findall(args)
            fd = _FD_PATH.match(args)
            if fd:
                found.append(fd.group(1))
            if any(p.startswith(r) for p in found for r in data_roots):
                counts["data"] += 1
            elif any(p.startswith("/dev/shm") for p in found):
                counts["shm"] += 1
    return counts


def _syscall_limit(args: argparse.Namespace, num_samples: int) -> int:
    """Samples of the long strace run: the whole epoch unless ``--syscall-samples`` caps it."""
    return num_samples if args.syscall_samples < 0 else min(num_samples, args.syscall_samples)


def _syscall_pass(
    outcome: Outcome, paths: dict[str, str], args: argparse.Namespace, num_samples: int
) -> None:
    """Two untimed runs under strace, over ``batch_size`` samples and over ``limit`` samples;
    the difference is the per-sample cost beyond start-up."""
    cfg = outcome.config
    data = paths[cfg.data]
    common.warm_up(data)
    limit = _syscall_limit(args, num_samples)
    roots = sorted({os.path.realpath(data), os.path.abspath(data)})
    counts = []
    for n in (args.batch_size, limit):
        log = os.path.join(args.workdir, f"read-strace-{cfg.name}-{n}.log")
        result_path = os.path.join(args.workdir, f"read-strace-{cfg.name}-{n}.json")
        argv = [STRACE, "-f", "-y", "-qq", "-e", f"trace={TRACED}", "-o", log]
        if args.seccomp_bpf:
            argv.insert(1, "--seccomp-bpf")
        run = common.run_child(argv + _child_argv(cfg, data, result_path, n, args))
        if run.returncode != 0 or not os.path.exists(result_path):
            print(f"[strace] {cfg.name}: failed: {run.stderr_tail[-300:]}", file=sys.stderr)
            return
        with open(result_path) as fh:
            samples = json.load(fh)["samples"]
        counts.append((samples, _count_syscalls(log, roots)))
        common.remove_path(log)
        common.remove_path(result_path)
    (n0, c0), (n1, c1) = counts
    delta = max(n1 - n0, 1)
    outcome.syscalls = {
        "startup_total": c0["total"],
        "startup_data": c0["data"],
        "per1000_total": (c1["total"] - c0["total"]) * 1000 / delta,
        "per1000_data": (c1["data"] - c0["data"]) * 1000 / delta,
        "per1000_shm": (c1["shm"] - c0["shm"]) * 1000 / delta,
        "samples": (n0, n1),
    }
    print(f"[strace] {cfg.name:24s} {outcome.syscalls}", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# Reporting.
# --------------------------------------------------------------------------------------------


def _find(outcomes: Sequence[Outcome], name: str) -> Outcome | None:
    for o in outcomes:
        if o.config.name == name and o.status == "ok":
            return o
    return None


def _verdict(ok: bool) -> str:
    return "**PASS**" if ok else "**FAIL**"


def _rate(o: Outcome, cache: str) -> tuple[float, float] | None:
    """(samples/s, MB/s) of the median run (by time)."""
    runs = o.runs(cache)
    if not runs:
        return None
    run = sorted(runs, key=lambda r: r.time_s)[(len(runs) - 1) // 2] if len(runs) % 2 else None
    t = o.time(cache)
    assert t is not None
    samples = run.samples if run else common.median([r.samples for r in runs])
    nbytes = run.nbytes if run else common.median([r.nbytes for r in runs])
    return samples / t, nbytes / 1e6 / t


def _ratio(a: Outcome | None, b: Outcome | None, cache: str) -> float | None:
    """Throughput of a over b (samples/s)."""
    if a is None or b is None:
        return None
    ra, rb = _rate(a, cache), _rate(b, cache)
    if ra is None or rb is None:
        return None
    return ra[0] / rb[0]


def _pct_raw(o: Outcome, outcomes: Sequence[Outcome], cache: str) -> float | None:
    """Payload MB/s over the raw limit's payload MB/s (= cat time / this time)."""
    raw = _find(outcomes, o.config.raw_ref)
    if raw is None or o.time(cache) is None or raw.time(cache) is None:
        return None
    ro, rr = _rate(o, cache), _rate(raw, cache)
    assert ro and rr
    return ro[1] / rr[1]


def _spread(runs: Sequence[Run]) -> str:
    times = [r.time_s for r in runs]
    return f"{common.median(times):.2f} ({min(times):.2f}-{max(times):.2f})"


def _report(
    outcomes: Sequence[Outcome],
    *,
    args: argparse.Namespace,
    paths: dict[str, str],
    num_samples: int,
    payload: int,
    cold: bool,
    started: str,
    load_before: str,
    load_after: str,
    elapsed_s: float,
    code_before: common.CodeState,
    code_after: common.CodeState,
) -> str:
    wds = _find(outcomes, "wds")
    rows = []
    for o in outcomes:
        if o.status != "ok":
            rows.append([o.config.label, o.config.order, o.status] + ["-"] * 8)
            continue
        row = [o.config.label, o.config.order]
        for cache in ("warm", "cold"):
            runs = o.runs(cache)
            rate = _rate(o, cache)
            if not runs or rate is None:
                row += ["-"] * 4 if cache == "warm" else ["-"] * 5
                continue
            pct = _pct_raw(o, outcomes, cache)
            vs = _ratio(o, wds, cache)
            row += [
                _spread(runs),
                f"{rate[0]:.0f}",
                f"{rate[1]:.0f}",
                f"{pct * 100:.0f}%" if pct is not None else "n/a",
            ]
            if cache == "cold":
                row.append(common.fmt_ratio(vs) if vs is not None and not o.config.raw else "-")
        rows.append(row)
    table = common.markdown_table(
        [
            "configuration",
            "order",
            "warm s, median (min-max)",
            "warm samples/s",
            "warm MB/s",
            "warm % of warm `cat`",
            "cold s, median (min-max)",
            "cold samples/s",
            "cold MB/s",
            "cold % of raw limit (cold `cat`)",
            "cold vs wds",
        ],
        rows,
    )

    cost_rows = []
    for o in outcomes:
        if o.status != "ok":
            continue
        s = o.syscalls
        all_runs = o.warm + o.cold
        cold_first = (
            f"{common.median([r.first_batch_s for r in o.cold]):.2f}"
            if o.cold and not o.config.raw
            else "-"
        )
        warm_ratio = _ratio(o, wds, "warm")
        cost_rows.append(
            [
                o.config.label,
                common.fmt_ratio(warm_ratio)
                if warm_ratio is not None and not o.config.raw
                else "-",
                f"{s['per1000_total']:.1f}" if s else "-",
                f"{s['per1000_data']:.1f}" if s else "-",
                f"{s['per1000_shm']:.1f}" if s else "-",
                f"{s['startup_total']} ({s['startup_data']})" if s else "-",
                cold_first,
                f"{max(r.max_rss for r in all_runs) / common.MiB:.0f}" if all_runs else "-",
                f"{max(r.tree_rss for r in all_runs) / common.MiB:.0f}" if all_runs else "-",
            ]
        )
    cost_table = common.markdown_table(
        [
            "configuration",
            "warm vs wds",
            "opens+stats / 1,000 samples beyond start-up",
            "of which on data files",
            "of which in /dev/shm",
            "start-up opens+stats (on data files)",
            "cold first batch s",
            "peak RSS MiB (largest process)",
            "peak RSS MiB (process tree, sampled)",
        ],
        cost_rows,
    )

    def get(name: str) -> Outcome | None:
        return _find(outcomes, name)

    targets: list[str] = []
    for fmt in ("tar", "hdf5"):
        o = get(f"shardio-stream-{fmt}")
        pct = _pct_raw(o, outcomes, "cold") if o else None
        targets.append(
            f"- shardio stream ({fmt}) cold ≥ {TARGET_STREAM_COLD_VS_CAT:.0%} of the raw `cat` "
            f"limit: "
            + (
                f"{pct:.0%} → {_verdict(pct >= TARGET_STREAM_COLD_VS_CAT)}"
                if pct is not None
                else "not measured"
            )
        )
    for fmt in ("tar", "hdf5"):
        o = get(f"shardio-stream-{fmt}")
        for peer, target, label in (
            ("wds", TARGET_WARM_VS_WDS, "webdataset"),
            ("mds", TARGET_WARM_VS_MDS, "streaming"),
            ("dali", TARGET_WARM_VS_DALI, "DALI CPU reader"),
        ):
            r = _ratio(o, get(peer), "warm")
            targets.append(
                f"- shardio stream ({fmt}) warm ≥ {target:g}x {label}: "
                + (f"{r:.2f}x → {_verdict(r >= target)}" if r is not None else "not measured")
            )
    for fmt in ("tar", "hdf5"):
        r = _ratio(get(f"shardio-map-{fmt}"), get("loose"), "cold")
        targets.append(
            f"- shardio map ({fmt}) cold, random access ≥ {TARGET_MAP_COLD_VS_LOOSE:g}x loose "
            "files: "
            + (f"{r:.2f}x → {_verdict(r >= TARGET_MAP_COLD_VS_LOOSE)}" if r else "not measured")
        )
    for o in outcomes:
        if o.config.name.startswith("shardio") and o.status == "ok":
            s = o.syscalls
            targets.append(
                f"- {o.config.label}: opens+stats per 1,000 samples beyond start-up < "
                f"{TARGET_OPENS_PER_1000:g}: "
                + (
                    f"{s['per1000_total']:.1f} → "
                    f"{_verdict(s['per1000_total'] < TARGET_OPENS_PER_1000)} (counting only "
                    f"calls on the data files: {s['per1000_data']:.1f} → "
                    f"{_verdict(s['per1000_data'] < TARGET_OPENS_PER_1000)})"
                    if s
                    else "not measured"
                )
            )

    notes = [f"- {o.config.label}: {o.status} — {o.note}" for o in outcomes if o.status != "ok"]
    for o in outcomes:
        for cache in ("warm", "cold"):
            for r in o.runs(cache):
                if not o.config.raw and (r.samples != num_samples or r.nbytes != payload):
                    notes.append(
                        f"- {o.config.label} ({cache}): delivered {r.samples} samples / "
                        f"{r.nbytes} bytes (the tree has {num_samples} / {payload})"
                    )
                    break
    raw = []
    for o in outcomes:
        for cache in ("warm", "cold"):
            runs = o.runs(cache)
            if runs:
                raw.append(
                    f"- {o.config.name} {cache}: "
                    + ", ".join(
                        f"{r.time_s:.2f}" + ("" if o.config.raw else f"/{r.wall_s:.1f}")
                        for r in runs
                    )
                )
    versions = ", ".join(
        f"{n} {common.package_version(n)}"
        for n in (
            "shardio",
            "torch",
            "webdataset",
            "mosaicml-streaming",
            "h5py",
            "nvidia-dali-cuda120",
            "numpy",
            "xxhash",
        )
    )
    cache = (
        "cold runs: `sync; echo 3 > /proc/sys/vm/drop_caches` after the child's imports, just "
        "before it starts the clock (its mapped libraries stay loaded; `cat` runs after a drop)"
        if cold
        else "**cold runs are not cold**: dropping caches was not permitted (not root)"
    )
    tar_bytes = sum(os.path.getsize(p) for p in _shard_files(paths["tar"], "tar"))
    h5_bytes = sum(os.path.getsize(p) for p in _shard_files(paths["hdf5"], "hdf5"))
    code = common.code_line(code_before, code_after, "read")
    argv = [
        ".venv/bin/python",
        "benchmarks/bench_read.py",
        "--files",
        str(args.files),
        "--repeat-warm",
        str(args.repeat_warm),
        "--repeat-cold",
        str(args.repeat_cold),
    ]
    n_tar = len(_shard_files(paths["tar"], "tar"))
    parts = [
        f"Run {started}; {versions}; `{common.first_line(['strace', '-V'])}`.",
        "",
        code,
        "",
        f"Data: the bench_pack tree (`scripts/gen_imagenet.py --files {args.files} --classes "
        f"{args.classes} --mean-kb {args.mean_kb:g}`), {num_samples} JPEGs, "
        f"{payload / 1e9:.3f} GB of payload, packed with `shardio pack --shard-size "
        f"{args.shard_size}` into {n_tar} tar shards ({tar_bytes / 1e9:.3f} GB, with the "
        f"`.idx` files DALI reads) and hdf5 shards ({h5_bytes / 1e9:.3f} GB), and copied with "
        f"streaming's `MDSWriter` (size_limit {args.shard_size}). One epoch per run, bytes "
        f"only (no decoding), batch size {args.batch_size}, a DataLoader with "
        f"{args.workers} workers (DALI: {args.workers} threads, in-process). Each "
        f"configuration is its own child process; runs are round-robin over the "
        f"configurations, {args.repeat_cold} cold then {args.repeat_warm} warm rounds "
        f"interleaved; {cache}. Warm runs follow a read of all the configuration's files. "
        f"Load average before / after: {load_before} / {load_after} (2 CPUs; other "
        f"sessions' tests were running on the machine); measuring took {elapsed_s:.0f} s.",
        "",
        "Time = building the dataset and loader (ImageFolder-style scan for loose files, "
        "index for shardio, index.json for streaming, member tables for h5py, pipeline build "
        "for DALI) + reading the whole epoch, from after the imports to the last batch; "
        "samples/s and MB/s (10^6 bytes of JPEG payload delivered) are over that time. "
        + (
            "The training process reads one byte per 4 KiB page of every sample it receives "
            "(nothing is decoded), so payloads delivered as views (shardio's mapped columns, "
            "DALI's tensors) are brought into the consumer like the peers' copied bytes. "
            if args.touch
            else "**Delivered payloads are not touched by the training process (--no-touch)**: "
            "views (shardio's mapped columns, DALI's tensors) are never faulted in. "
        )
        + "`cat` rows: process wall of `cat SHARDS` with stdout to /dev/null, expressed as the "
        "payload it carries (so % of raw = `cat` time / this time).",
        "",
        table,
        "",
        cost_table,
        "",
        f"Opens+stats: `strace -f -y -e trace={TRACED}` over a run of {args.batch_size} samples "
        f"(start-up) and one of {_syscall_limit(args, num_samples)}, both warm and "
        f"untimed; the difference per 1,000 samples is the steady-state cost (the column "
        f"'start-up' is the short run's total, imports included; in parentheses those naming "
        f"the data files). 'On data files' = calls whose path or fd (`-y`) is under the "
        f"configuration's data directory: the calls a parallel filesystem's metadata server "
        f"would see. Peak RSS (largest process) is ru_maxrss from wait4 over the timed runs; "
        f"the tree figure sums the RSS of the child and its workers, sampled every 0.1 s "
        f"(shared pages count once per process).",
        "",
        "Peers as configured: shardio `ShardDataset(path, mode=..., shuffle=True, seed=0)"
        f".loader(batch_size={args.batch_size}, num_workers={args.workers})` (its default "
        "prefetch_factor 4; stream order is shard-local: shards shuffled, samples shuffled "
        "within windows of 4 shards); loose files: a map-style Dataset over the file list, "
        "`DataLoader(shuffle=True)`; `wds.WebDataset(urls, shardshuffle=False)"
        ".to_tuple('jpeg', 'cls').batched(64)` in a `DataLoader(batch_size=None)` (shards split "
        "by worker); `StreamingDataset(local=MDS, remote=None, shuffle=False, batch_size=64)` "
        "in a `DataLoader(batch_size=64)`; naive h5py: map-style, `h5py.File` opened lazily per "
        "worker and shard, `f['data'][off:off+size].tobytes()` per sample, `shuffle=True`; "
        "DALI: `fn.readers.webdataset(paths, index_paths, ext=['jpeg', 'cls'])` in a pipeline "
        "with `device_id=None, num_threads=2`. The peers' DataLoaders keep the default "
        "prefetch_factor 2.",
        "",
        "Targets:",
        "",
        *targets,
    ]
    if notes:
        parts += ["", "Notes:", "", *notes]
    parts += [
        "",
        "Raw times (s; python rows: measured time / process wall), in run order:",
        "",
        *raw,
        "",
        "Reproduce:",
        "",
        "```",
        shlex.join(argv),
        "```",
        "",
        "Each child (DATA = the tar, hdf5 or MDS directory or the tree):",
        "",
        "```",
        *(
            _cat_shell(o.config)
            if o.config.raw
            else _shell([*_child_argv(o.config, "DATA", "RESULT", 0, args), "--handshake"])
            for o in outcomes
        ),
        "```",
    ]
    return "\n".join(parts)


def _shell(argv: Sequence[str]) -> str:
    return shlex.join(argv).replace(REPO + "/", "")


def _parse_size(text: str) -> int:
    units = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "KB": 1000, "MB": 10**6, "GB": 10**9}
    for suffix, mult in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


def _strace_supports_seccomp() -> bool:
    run = common.run_child([STRACE, "-f", "--seccomp-bpf", "-qq", "-o", "/dev/null", "true"])
    return run.returncode == 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the read benchmark and update RESULTS.md."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_child"]:
        return _child(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20000)
    parser.add_argument("--mean-kb", type=float, default=110.0)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--repeat-warm", type=int, default=3)
    parser.add_argument("--repeat-cold", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size", default="256MiB", help="shard size of every writer")
    parser.add_argument(
        "--syscall-samples",
        type=int,
        default=-1,
        help="samples of the long strace run (-1, the default: the whole epoch, so that shard "
        "changes count; 0 skips the strace pass)",
    )
    parser.add_argument(
        "--no-touch",
        dest="touch",
        action="store_false",
        help="do not read one byte per page of each delivered sample in the training process",
    )
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--regen", action="store_true", help="regenerate the tree and packs")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(argv)
    args.shard_size_bytes = _parse_size(args.shard_size)
    args.workdir = os.path.abspath(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)
    common.hold_bench_lock(args.workdir)

    configs = list(CONFIGS)
    configs = common.select_named(parser, args.only, configs)

    src = common.ensure_tree(
        REPO,
        args.workdir,
        files=args.files,
        classes=args.classes,
        mean_kb=args.mean_kb,
        regen=args.regen,
    )
    paths = _ensure_data(args, src)
    num_samples, payload = common.tree_payload(src)
    outcomes = [Outcome(c) for c in configs]
    for o in outcomes:
        if not os.path.isdir(paths[o.config.data]):
            o.status, o.note = "unavailable", f"no {o.config.data} copy"
    args.seccomp_bpf = _strace_supports_seccomp()

    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    load_before = common.loadavg()
    code_before = common.code_state(REPO)
    t0 = time.perf_counter()
    cold_ok = [True]
    for rnd in range(max(args.repeat_warm, args.repeat_cold)):
        for cache, repeat in (("cold", args.repeat_cold), ("warm", args.repeat_warm)):
            if rnd >= repeat:
                continue
            for o in outcomes:
                if o.status == "ok":
                    _measure_one(o, cache, paths, args, num_samples, payload, cold_ok)
    if args.syscall_samples:
        for o in outcomes:
            if o.status == "ok" and not o.config.raw:
                _syscall_pass(o, paths, args, num_samples)
    elapsed = time.perf_counter() - t0
    print(f"measured in {elapsed:.0f} s", file=sys.stderr)
    body = _report(
        outcomes,
        args=args,
        paths=paths,
        num_samples=num_samples,
        payload=payload,
        cold=cold_ok[0],
        started=started,
        load_before=load_before,
        load_after=common.loadavg(),
        elapsed_s=elapsed,
        code_before=code_before,
        code_after=common.code_state(REPO),
    )
    common.publish(body, SECTION, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
