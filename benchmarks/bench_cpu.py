"""CPU per verified GB: shardio and the peers against the floor (readinto + xxh3) and ``cat``.

Every core a loader uses is one that decoding and augmentation do not get, so this measures
how much CPU each reader spends per GB of verified payload it hands to the training process.
On bench_read's data (the generated JPEG tree, its shardio tar and hdf5 packs, an MDS copy,
and a litdata copy), each configuration in its own child process, round-robin, median of
``--repeat`` rounds, warm and cold (caches dropped after the child's imports), on the local
disk and (``--fs local,bed``) on a MooseFS bed (bench_pfs's ``Bed``, always taken down):

- the floor: one process reads every tar shard sequentially with ``readinto`` a reused
  8 MiB buffer and hashes each shard with xxh3-64 (what no loader can beat); a variant that
  reads each shard whole and hashes each member separately; ``cat`` of the shards;
- three ceilings, each what a configuration cannot avoid and nothing else: every member
  read by one ``pread`` and hashed, in a random order each epoch (a shuffled epoch: on a
  cold page cache random reads cost the reader more CPU than sequential ones), in one
  process, in ``--workers`` processes at once (two readers share caches and memory
  bandwidth), and in a bare ``DataLoader``'s ``--workers`` workers reading into reused
  shared memory (their processes and hand-off). Each shardio row is also given as a ratio
  to the ceiling of its configuration;
- shardio map and stream with 0 and ``--workers`` workers, and with ``--workers`` reader
  threads (``threads=True``); (``--baseline REV``) the worker rows again with an earlier
  commit (a ``git worktree add --detach``) on ``PYTHONPATH``;
- the peers with ``--workers`` workers: loose files, SPDL (threads), webdataset, mosaic
  streaming, litdata, plain h5py (and DALI's CPU reader where it is installed).

A child's CPU is ``getrusage`` of itself and its reaped children (its DataLoader workers,
persistent ones included: the loader is collected before the second reading), from just
after its imports to after the loader's teardown; ``cat``'s is its ``wait4`` rusage. Two
epochs per child (``--epochs``), bytes only, batch size 64. The section "## CPU per verified
GB" of benchmarks/RESULTS.md is rewritten; other sections are kept.

Usage::

    sudo PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_cpu.py [--files 6000]
        [--repeat 3] [--fs local,bed] [--baseline e3e2b7b] [--only NAME,...] [--no-write]

Not a test: it measures and reports, and asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_read
import common
import cpu_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ME = os.path.abspath(__file__)
SECTION = cpu_report.SECTION
PEER_UNAVAILABLE = bench_read.PEER_UNAVAILABLE
BUFFER = 8 * common.MiB
BASELINE = "e3e2b7b"  # the commit before issue 37's read-path changes
FILESYSTEMS = ("local", "bed")
CACHES = ("warm", "cold")


# --------------------------------------------------------------------------------------------
# The floor: read and hash, nothing else.
# --------------------------------------------------------------------------------------------


def tar_members(buf: memoryview, end: int) -> Iterator[tuple[int, int]]:
    """(offset, size) of each regular member's data in the tar bytes ``buf[:end]``.

    Headers of other types (pax and GNU long-name records, directories) are skipped; the
    walk stops at the end-of-archive block or at ``end``.

    Raises:
        ValueError: a header's size field is not octal, or a member runs past ``end``.
    """
    pos = 0
    while pos + 512 <= end:
        if buf[pos] == 0:  # an empty name: the end-of-archive block
            return
        field_ = bytes(buf[pos + 124 : pos + 136]).strip(b"\0 ")
        size = int(field_ or b"0", 8)
        data = pos + 512
        if data + size > end:
            raise ValueError(f"a tar member at byte {pos} runs past the end ({end})")
        if buf[pos + 156] in (0x30, 0):  # '0' or NUL: a regular file
            yield data, size
        pos = data + (size + 511) // 512 * 512


def read_floor(shards: Sequence[str], *, members: bool, epochs: int = 1) -> dict[str, Any]:
    """Read every shard sequentially and hash it with xxh3-64: the floor no loader can beat.

    Args:
        shards: the tar shard files, read in this order.
        members: read each shard whole into one reused buffer and hash each regular member
            separately (what a reader that verifies per member cannot avoid); otherwise
            ``readinto`` a reused 8 MiB buffer and hash the shard as one stream.
        epochs: passes over ``shards``.

    Returns:
        ``read_bytes``, ``hashed_bytes``, ``hashes`` (number of digests) and ``digest`` (the
        xor of all digests, so that nothing is optimised away and tests can compare).
    """
    import xxhash

    buf = bytearray(BUFFER)
    view = memoryview(buf)
    read = hashed = hashes = digest = 0
    for _ in range(epochs):
        for path in shards:
            with open(path, "rb", buffering=0) as fh:
                if not members:
                    h = xxhash.xxh3_64()
                    while n := fh.readinto(view):
                        h.update(view[:n])
                        read += n
                        hashed += n
                    digest ^= h.intdigest()
                    hashes += 1
                    continue
                size = os.fstat(fh.fileno()).st_size
                if size > len(buf):
                    view.release()
                    buf = bytearray(size)
                    view = memoryview(buf)
                end = 0
                while end < size and (n := fh.readinto(view[end : min(size, end + BUFFER)])):
                    end += n
                read += end
                for off, length in tar_members(view, end):
                    digest ^= xxhash.xxh3_64_intdigest(view[off : off + length])
                    hashed += length
                    hashes += 1
    return {"read_bytes": read, "hashed_bytes": hashed, "hashes": hashes, "digest": digest}


def member_extents(path: str) -> list[tuple[int, int]]:
    """(offset, size) of each regular member of the tar at ``path``, from its headers alone
    (one 512-byte ``pread`` per header; pax and GNU records skipped as in :func:`tar_members`).

    Raises:
        ValueError: a header's size field is not octal, or a member runs past the file's end.
    """
    out = []
    fd = os.open(path, os.O_RDONLY)
    try:
        end = os.fstat(fd).st_size
        pos = 0
        while pos + 512 <= end:
            header = os.pread(fd, 512, pos)
            if len(header) < 512 or header[0] == 0:
                break
            size = int(header[124:136].strip(b"\0 ") or b"0", 8)
            data = pos + 512
            if data + size > end:
                raise ValueError(f"{path}: a tar member at byte {pos} runs past the end ({end})")
            if header[156] in (0x30, 0):
                out.append((data, size))
            pos = data + (size + 511) // 512 * 512
    finally:
        os.close(fd)
    return out


def open_extents(shards: Sequence[str]) -> list[tuple[int, int, int]]:
    """(descriptor, offset, size) of every regular member of ``shards``, each shard opened
    once (the descriptors stay open: a reader holds its shards open)."""
    out = []
    for path in shards:
        extents = member_extents(path)
        fd = os.open(path, os.O_RDONLY)
        out += [(fd, off, size) for off, size in extents]
    return out


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The random order of ``count`` members in ``epoch`` (the same in every reader)."""
    import numpy as np

    return np.random.default_rng([seed, epoch]).permutation(count).tolist()  # type: ignore[no-any-return]


def read_extents(
    extents: Sequence[tuple[int, int, int]],
    *,
    epochs: int,
    seed: int,
    share: tuple[int, int] = (0, 1),
) -> dict[str, Any]:
    """The floor of random access: each member of ``extents`` read by one ``pread`` into a
    reused buffer and hashed with xxh3-64, in a random order each epoch (what a shuffled
    epoch cannot avoid: on a cold page cache random reads cost the reader more CPU than
    sequential ones). ``share`` = (k, n): every n-th member of the order from the k-th.

    Returns:
        As :func:`read_floor`.

    Raises:
        ValueError: a member read short.
    """
    import xxhash

    buf = bytearray(max((size for _, _, size in extents), default=0))
    view = memoryview(buf)
    read = hashes = digest = 0
    me, every = share
    for epoch in range(epochs):
        for i in epoch_order(len(extents), seed, epoch)[me::every]:
            fd, off, size = extents[i]
            n = os.preadv(fd, [view[:size]], off)
            if n != size:
                raise ValueError(f"a member of {size} bytes at {off} read short ({n})")
            digest ^= xxhash.xxh3_64_intdigest(view[:size])
            read += n
            hashes += 1
    return {"read_bytes": read, "hashed_bytes": read, "hashes": hashes, "digest": digest}


def read_floor_shuffled(
    extents: Sequence[tuple[int, int, int]], *, epochs: int = 1, seed: int = 0, procs: int = 1
) -> dict[str, Any]:
    """:func:`read_extents` in ``procs`` processes at once, each every ``procs``-th member of
    the order (what splitting one reader costs by itself: shared caches and memory
    bandwidth); their CPU is reaped by this process (``RUSAGE_CHILDREN``). The digest is
    not gathered from the processes (0).

    Raises:
        RuntimeError: a reader process failed.
    """
    if procs == 1:
        return read_extents(extents, epochs=epochs, seed=seed)
    pids = []
    for p in range(procs):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 0
            try:
                read_extents(extents, epochs=epochs, seed=seed, share=(p, procs))
            except BaseException:
                code = 1
            os._exit(code)
        pids.append(pid)
    failed = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
    if failed:
        raise RuntimeError(f"{len(failed)} of {procs} floor readers failed")
    read = epochs * sum(size for _, _, size in extents)
    return {"read_bytes": read, "hashed_bytes": read, "hashes": epochs * len(extents), "digest": 0}


def read_floor_loader(
    extents: Sequence[tuple[int, int, int]],
    *,
    workers: int,
    batch_size: int,
    epochs: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """:func:`read_extents` through a ``torch.utils.data.DataLoader`` with ``workers``
    worker processes, and nothing else: each worker reads every ``workers``-th member of
    the order, ``batch_size`` at a time, each by one ``pread`` into the next of its own
    reused shared-memory slots, hashes each member with xxh3-64 and sends only (slot,
    length, digest); the training process reads one byte per 4 KiB page of each batch (as
    the loader rows' loop does). What the DataLoader's worker processes and their hand-off
    cost, below any loader built on them: no index, no per-sample Python in the training
    process.
    """
    import numpy as np
    import torch
    import xxhash
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    sizes = np.array([size for _, _, size in extents], dtype=np.int64)
    slot_bytes = 1
    for epoch in range(epochs):  # the largest batch any worker reads
        order = np.asarray(epoch_order(len(extents), seed, epoch), dtype=np.int64)
        for me in range(workers):
            mine = sizes[order[me::workers]]
            for lo in range(0, len(mine), batch_size):
                slot_bytes = max(slot_bytes, int(mine[lo : lo + batch_size].sum()))
    prefetch = 2
    slots = prefetch + 2  # a worker is at most prefetch + 1 batches ahead of the one in use
    ring = torch.empty(workers * slots * slot_bytes, dtype=torch.uint8).share_memory_()
    board = torch.zeros(1, dtype=torch.int64).share_memory_()  # the epoch, for kept workers

    class Members(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Iterator[tuple[int, int, int]]:
            info = get_worker_info()
            me = info.id if info is not None else 0
            view = memoryview(ring.numpy())  # type: ignore[arg-type]
            mine = epoch_order(len(extents), seed, int(board[0]))[me::workers]
            for k, lo in enumerate(range(0, len(mine), batch_size)):
                slot = me * slots + k % slots
                at = base = slot * slot_bytes
                digest = 0
                for i in mine[lo : lo + batch_size]:
                    fd, off, size = extents[i]
                    target = view[at : at + size]
                    if os.preadv(fd, [target], off) != size:
                        raise ValueError(f"a member of {size} bytes at {off} read short")
                    digest ^= xxhash.xxh3_64_intdigest(target)
                    at += size
                yield slot, at - base, digest

    loader = DataLoader(
        Members(), batch_size=None, num_workers=workers, prefetch_factor=prefetch,
        persistent_workers=True,
    )  # fmt: skip
    view = memoryview(ring.numpy())  # type: ignore[arg-type]
    read = hashes = digest = touched = 0
    for epoch in range(epochs):
        board[0] = epoch  # each iteration starts the kept workers' __iter__ again
        for slot, n, h in loader:
            base = int(slot) * slot_bytes
            touched += sum(view[base : base + int(n) : 4096])
            read += int(n)
            hashes += 1
            digest ^= int(h)
    del loader
    gc.collect()  # the persistent workers joined: their CPU reaped
    return {"read_bytes": read, "hashed_bytes": read, "hashes": hashes, "digest": digest}


def _floor_child(argv: Sequence[str]) -> int:
    """``bench_cpu.py _floor DATA RESULT [--members | --shuffled [--procs N | --loader N]]
    [--epochs N] [--seed S] [--batch-size B] [--handshake]``."""
    parser = argparse.ArgumentParser(prog="bench_cpu.py _floor")
    parser.add_argument("data")
    parser.add_argument("result")
    parser.add_argument("--members", action="store_true")
    parser.add_argument("--shuffled", action="store_true")
    parser.add_argument("--procs", type=int, default=1)
    parser.add_argument("--loader", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--handshake", action="store_true")
    args = parser.parse_args(argv)
    import numpy  # noqa: F401 - imported before the clock
    import xxhash  # noqa: F401

    if args.loader:
        import torch.utils.data  # noqa: F401

    shards = sorted(glob.glob(os.path.join(args.data, "shards", "*.tar")))
    # The member list from the headers, before the clock (and the cold run's drop).
    extents = open_extents(shards) if args.shuffled else []
    if args.handshake:
        common.child_handshake()
    # As the loader rows' child does: what the imports left on the heap is frozen, so that
    # the collection that reaps the workers walks what the run made, not all of torch (and
    # the forked workers' first collections copy none of the parent's pages).
    gc.collect()
    gc.freeze()
    cpu0 = bench_read._cpu_now()
    t0 = time.perf_counter()
    if args.shuffled and args.loader:
        got = read_floor_loader(
            extents, workers=args.loader, batch_size=args.batch_size, epochs=args.epochs,
            seed=args.seed,
        )  # fmt: skip
    elif args.shuffled:
        got = read_floor_shuffled(extents, epochs=args.epochs, seed=args.seed, procs=args.procs)
    else:
        got = read_floor(shards, members=args.members, epochs=args.epochs)
    t1 = time.perf_counter()
    cpu1 = bench_read._cpu_now()
    with open(args.result, "w") as fh:
        json.dump(
            {
                **got,
                "time_s": t1 - t0,
                "cpu_user_s": cpu1[0] - cpu0[0],
                "cpu_sys_s": cpu1[1] - cpu0[1],
                "live_children": 0,
            },
            fh,
        )
    return 0


def _epoch_child(argv: Sequence[str]) -> int:
    """``bench_cpu.py _child ...``: bench_read's epoch child, with bench_pfs's litdata and
    SPDL readers registered."""
    import bench_pfs

    bench_read._PREPS.setdefault("litdata", bench_pfs._prep_litdata)
    bench_read._PREPS.setdefault("spdl", bench_pfs._prep_spdl)
    return bench_read._child(argv)


# --------------------------------------------------------------------------------------------
# Configurations.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One measured configuration."""

    name: str
    label: str
    kind: str  # floor | cat | child
    data: str  # tar | hdf5 | mds | litdata | tree
    child: str = ""  # bench_read child name
    workers: int = 0
    members: bool = False  # floor: hash per member
    variant: str = ""  # floor: "shuffled", "procs" or "loader" (random order; workers: how many)
    base: bool = False  # run with the --baseline commit's shardio
    peer: bool = False  # rounds limited by --peer-repeat

    @property
    def shardio(self) -> str:
        """ "map" or "stream" for shardio's rows, "" otherwise."""
        for mode in ("map", "stream"):
            if self.child in (f"shardio-{mode}-tar", f"shardio-{mode}-tar-threads"):
                return mode
        return ""


def configs(workers: int, baseline: str) -> list[Config]:
    """Every configuration: the floors, ``cat``, shardio (and its baseline), the peers."""
    out = [
        Config("floor", "floor: `readinto` 8 MiB + xxh3-64 per shard", "floor", "tar"),
        Config(
            "floor-members",
            "floor variant: shard read whole, xxh3-64 per member",
            "floor",
            "tar",
            members=True,
        ),
        Config("cat", "`cat` of the tar shards > /dev/null", "cat", "tar"),
        Config(
            "floor-shuffled",
            "ceiling, random order: one `pread` + xxh3-64 per member, all members shuffled",
            "floor",
            "tar",
            variant="shuffled",
        ),
        Config(
            f"floor-shuffled-p{workers}",
            f"ceiling, random order in {workers} processes at once, each a share",
            "floor",
            "tar",
            workers=workers,
            variant="procs",
        ),
        Config(
            f"floor-loader-w{workers}",
            f"ceiling, random order in a bare DataLoader's {workers} workers, into reused "
            "shared memory",
            "floor",
            "tar",
            workers=workers,
            variant="loader",
        ),
    ]
    for base in (False, True) if baseline else (False,):
        for mode in ("map", "stream"):
            for w in (0, workers):
                tag = f"@{baseline}" if base else ""
                out.append(
                    Config(
                        f"shardio-{mode}-w{w}{'-base' if base else ''}",
                        f"shardio {mode}, {w} workers{tag}",
                        "child",
                        "tar",
                        child=f"shardio-{mode}-tar",
                        workers=w,
                        base=base,
                    )
                )
    out += [
        Config(
            f"shardio-{mode}-t{workers}",
            f"shardio {mode}, {workers} reader threads (`threads=True`)",
            "child",
            "tar",
            child=f"shardio-{mode}-tar-threads",
            workers=workers,
        )
        for mode in ("map", "stream")
    ]
    peers = [
        ("loose", "loose files, `open().read()`, DataLoader", "tree"),
        ("spdl", "SPDL thread pipeline over loose files", "tree"),
        ("wds", "webdataset `WebDataset`", "tar"),
        ("mds", "mosaic streaming `StreamingDataset` (MDS)", "mds"),
        ("litdata", "litdata `StreamingDataset`", "litdata"),
        ("h5py", "plain h5py (shardio's hdf5 shards)", "hdf5"),
        ("dali", "DALI `fn.readers.webdataset` (CPU, threads)", "tar"),
    ]
    out += [
        Config(n, f"{label}, {workers} workers", "child", d, child=n, workers=workers, peer=True)
        for n, label, d in peers
    ]
    return out


# --------------------------------------------------------------------------------------------
# Measuring.
# --------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """All runs of one configuration: per (fs, cache), a list of run dicts."""

    config: Config
    runs: dict[tuple[str, str], list[dict[str, float]]] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)  # fs -> "" (ok) or why not
    notes: list[str] = field(default_factory=list)
    live: int = 0  # most children alive after a run's teardown (CPU from /proc added)


def _env(root: str, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = root  # the shardio measured (this tree or the baseline's)
    env["SHARDIO_BENCH_SPDL_THREADS"] = str(threads)
    env.pop("SHARDIO_READ_STRATEGY", None)
    return env


def _child_argv(cfg: Config, data: str, result: str, args: argparse.Namespace) -> list[str]:
    if cfg.kind == "floor":
        argv = [sys.executable, ME, "_floor", data, result, "--epochs", str(args.epochs)]
        if cfg.members:
            argv.append("--members")
        elif cfg.variant:
            argv += ["--shuffled", "--seed", str(args.seed)]
            if cfg.variant != "shuffled":
                argv += [f"--{cfg.variant}", str(cfg.workers)]
            if cfg.variant == "loader":
                argv += ["--batch-size", str(args.batch_size)]
        return [*argv, "--handshake"]
    return [
        sys.executable, ME, "_child", cfg.child, data, result,
        "--batch-size", str(args.batch_size), "--workers", str(cfg.workers),
        "--seed", str(args.seed), "--epochs", str(args.epochs), "--handshake",
    ]  # fmt: skip


def _shards(tar_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(tar_dir, "shards", "*.tar")))


def measure(
    o: Outcome,
    fs: str,
    cache: str,
    paths: dict[str, str],
    args: argparse.Namespace,
    sizes: tuple[int, int],
) -> None:
    """One run of ``o`` on ``fs`` with a ``cache`` page cache; appended to ``o.runs``."""
    cfg = o.config
    if o.status.get(fs):
        return
    num_samples, payload = sizes
    data = paths[cfg.data]
    if cache == "warm":
        common.warm_up(data)
    drop = common.drop_caches if cache == "cold" else (lambda: True)
    result: dict[str, Any] | None = None
    if cfg.kind == "cat":
        if not drop():
            args.cold_ok = False
        run = common.run_child(["cat", *_shards(data) * args.epochs], timeout_s=args.timeout)
        if run.returncode == 0:
            result = {"time_s": run.wall_s, "cpu_user_s": run.user_s, "cpu_sys_s": run.sys_s}
    else:
        result_path = os.path.join(args.workdir, f"cpu-result-{cfg.name}.json")
        common.remove_path(result_path)

        def ready() -> None:
            if not drop():
                args.cold_ok = False

        root = args.base_tree if cfg.base else REPO
        run = common.run_child(
            _child_argv(cfg, data, result_path, args),
            env=_env(root, args.workers),
            on_ready=ready,
            timeout_s=args.timeout,
        )
        if run.returncode == 0 and os.path.exists(result_path):
            with open(result_path) as fh:
                result = json.load(fh)
        common.remove_path(result_path)
        module = (result or {}).get("shardio_module")
        if cfg.shardio and result is not None and not _under(module, root):
            o.status[fs] = f"imported shardio from {module}, not from {root}"
            result = None
    if result is None:
        if not o.status.get(fs):
            lines = [ln for ln in run.stderr_tail.strip().splitlines() if ln.strip()]
            why = "timed out" if run.timed_out else f"exit {run.returncode}"
            what = "unavailable" if run.returncode == PEER_UNAVAILABLE else "failed"
            o.status[fs] = f"{what} ({why}): {lines[-1].strip()[:200] if lines else '?'}"
        print(f"[{fs} {cache}] {cfg.name:22s} {o.status[fs]}", file=sys.stderr)
        return
    if cfg.kind != "child":  # the floors and cat carry the whole payload each epoch
        result["samples"], result["bytes"] = num_samples * args.epochs, payload * args.epochs
    elif result["samples"] != num_samples * args.epochs or result["bytes"] != payload * args.epochs:
        o.notes.append(
            f"{fs} {cache}: delivered {result['samples']} samples / {result['bytes']} bytes "
            f"(expected {num_samples * args.epochs} / {payload * args.epochs})"
        )
    live = result.get("live_children", 0)
    if live:
        o.live = max(o.live, live)
    result["cpu_s"] = (
        result["cpu_user_s"] + result["cpu_sys_s"] + result.get("live_children_cpu_s", 0.0)
    )
    result["process_wall_s"] = run.wall_s
    o.runs.setdefault((fs, cache), []).append(result)
    r = result
    print(
        f"[{fs} {cache}] {cfg.name:22s} {r['time_s']:6.2f} s  cpu {r['cpu_s']:6.2f} s  "
        f"{r['cpu_s'] / (r['bytes'] / 1e9):5.2f} CPU-s/GB  "
        f"{r['bytes'] / 1e6 / r['time_s']:6.0f} MB/s  load {common.loadavg()}",
        file=sys.stderr,
    )


def _under(module: str | None, root: str) -> bool:
    return bool(module) and os.path.abspath(str(module)).startswith(os.path.abspath(root) + os.sep)


@contextlib.contextmanager
def baseline_tree(rev: str, workdir: str) -> Iterator[str]:
    """A ``git worktree add --detach`` of ``rev`` under ``workdir``, removed on exit."""
    for stale in glob.glob(os.path.join(workdir, "cpu-baseline-*")):  # a killed run's
        _remove_worktree(stale)  # (the bench lock is held: no other run uses one now)
    subprocess.run(["git", "-C", REPO, "worktree", "prune"], check=False, capture_output=True)
    path = os.path.join(workdir, f"cpu-baseline-{os.getpid()}")
    subprocess.run(
        ["git", "-C", REPO, "worktree", "add", "--detach", path, rev],
        check=True, capture_output=True,
    )  # fmt: skip
    try:
        build_native(path)
        yield path
    finally:
        _remove_worktree(path)


# Builds a tree's compiled modules in place from its own pyproject.toml, as `pip install -e`
# does here (argv[1]: the [[tool.setuptools.ext-modules]] tables, as JSON).
_BUILD = """
import json, sys
from setuptools import Distribution, Extension
from setuptools.command.build_ext import build_ext
exts = [
    Extension(m["name"], m["sources"], depends=m.get("depends", []),
              extra_compile_args=m.get("extra-compile-args", []))
    for m in json.loads(sys.argv[1])
]
cmd = build_ext(Distribution({"ext_modules": exts}))
cmd.inplace = True
cmd.ensure_finalized()
cmd.run()
"""


def build_native(tree: str) -> list[str]:
    """Build the compiled modules of ``tree`` (a baseline worktree: git holds no build) in
    place, so that its rows measure the read path that commit shipped, not its pure-Python
    fallback. Returns the modules' names (none at a commit before they existed).

    Raises:
        RuntimeError: a module failed to build.
    """
    import tomllib

    with open(os.path.join(tree, "pyproject.toml"), "rb") as fh:
        tables = tomllib.load(fh).get("tool", {}).get("setuptools", {}).get("ext-modules", [])
    if not tables:
        return []
    done = subprocess.run(
        [sys.executable, "-c", _BUILD, json.dumps(tables)], cwd=tree, capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
        raise RuntimeError(f"building {tree}'s compiled modules failed: {tail[0]}")
    return [t["name"] for t in tables]


def _remove_worktree(path: str) -> None:
    subprocess.run(
        ["git", "-C", REPO, "worktree", "remove", "--force", path],
        check=False, capture_output=True,
    )  # fmt: skip
    common.remove_path(path)


def _ensure_litdata(args: argparse.Namespace, src: str, paths: dict[str, str]) -> None:
    """A litdata copy beside bench_read's packs (``bench_pfs.py _write_litdata``)."""
    dst = os.path.join(os.path.dirname(paths["tar"]), "litdata")
    stamp = dst + ".done"
    if not os.path.exists(stamp) or args.regen:
        common.remove_path(dst)
        argv = [
            sys.executable, os.path.join(os.path.dirname(ME), "bench_pfs.py"),
            "_write_litdata", src, dst, str(args.shard_size_bytes),
        ]  # fmt: skip
        print("preparing", shlex.join(argv), file=sys.stderr)
        if common.run_child(argv, env=_env(REPO, args.workers)).returncode != 0:
            common.remove_path(dst)
            return
        with open(stamp, "w") as fh:
            fh.write(shlex.join(argv) + "\n")
    paths["litdata"] = dst


def _rounds(
    outcomes: Sequence[Outcome],
    fs: str,
    paths: dict[str, str],
    args: argparse.Namespace,
    sizes: tuple[int, int],
) -> None:
    for rnd in range(args.repeat):
        shift = rnd % len(outcomes)  # round-robin, each round starting one later
        order = list(outcomes[shift:]) + list(outcomes[:shift])
        for cache in args.caches:
            for o in order:
                if o.config.peer and rnd >= args.peer_repeat:
                    continue
                if o.config.data not in paths:
                    o.status[fs] = f"no {o.config.data} copy"
                    continue
                measure(o, fs, cache, paths, args, sizes)


def _on_bed(
    outcomes: Sequence[Outcome], tree: str, args: argparse.Namespace, sizes: tuple[int, int]
) -> dict[str, Any]:
    import bench_pfs

    bed = bench_pfs.Bed(args.bed_dir, chunkservers=2, ioretries=3)
    facts: dict[str, Any] = {"bed_argv": bed.up_argv}
    try:
        print("bed:", shlex.join(bed.up_argv), file=sys.stderr)
        bed.up()
        wanted = {o.config.data for o in outcomes} | {"tar"}
        paths, done = bench_pfs._prepare(tree, bed, args, wanted)
        paths = {k: v for k, v in paths.items() if k in done and not done[k][2]}
        facts["prepared"] = {k: v[0] for k, v in done.items()}
        _rounds(outcomes, "bed", paths, args, sizes)
    finally:
        failed = bed.down_reported()
        if failed is not None:
            facts["down_failed"] = failed
    return facts


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=6000)
    parser.add_argument("--mean-kb", type=float, default=110.0)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--shard-size", default="64MiB")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (medians over them)")
    parser.add_argument("--peer-repeat", type=int, default=None, help="rounds of the peers")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per child")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="workers of the peers' rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fs", default="local", help="local, bed or local,bed")
    parser.add_argument("--cache", default="warm,cold", help="warm, cold or warm,cold")
    parser.add_argument("--baseline", default=BASELINE, help="commit to compare (none: skip)")
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--timeout", type=float, default=600.0, help="kill a child after this")
    parser.add_argument("--bed-dir", default="", help="new or empty (default: /tmp/...)")
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--regen", action="store_true", help="regenerate the tree and packs")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(argv)
    for name, top in (("files", 10**7), ("repeat", 100), ("epochs", 100), ("batch_size", 10**5)):
        value = getattr(args, name)
        if not 1 <= value <= top:
            parser.error(f"--{name.replace('_', '-')} must be 1 to {top}, got {value}")
    if not 1 <= args.workers <= 64:
        parser.error(f"--workers must be 1 to 64, got {args.workers}")
    args.peer_repeat = args.repeat if args.peer_repeat is None else args.peer_repeat
    if not 0 <= args.peer_repeat <= args.repeat:
        parser.error(f"--peer-repeat must be 0 to --repeat ({args.repeat})")
    if not (0 < args.mean_kb < 1e6 and 0 < args.timeout <= 86400):  # NaN fails too
        parser.error("--mean-kb and --timeout must be positive numbers (--timeout ≤ 86400)")
    args.fss = _choices(parser, "--fs", args.fs, FILESYSTEMS)
    args.caches = _choices(parser, "--cache", args.cache, CACHES)
    try:
        args.shard_size_bytes = bench_read._parse_size(args.shard_size)
    except ValueError:
        parser.error(f"--shard-size: '{args.shard_size}' is not a size such as 64MiB")
    if args.shard_size_bytes < 1:
        parser.error(f"--shard-size must be positive, got {args.shard_size}")
    if ("bed" in args.fss or "cold" in args.caches) and os.geteuid() != 0:
        parser.error("needs root for --fs bed and for cold runs (drop_caches)")
    args.baseline = "" if args.baseline in ("", "none") else args.baseline
    if args.baseline:
        rev = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--verify", "--short", args.baseline + "^{commit}"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if rev.returncode != 0:
            parser.error(f"--baseline: '{args.baseline}' is not a commit of {REPO}")
        args.baseline = rev.stdout.strip()
    args.configs = common.select_named(parser, args.only, configs(args.workers, args.baseline))
    args.workdir = os.path.abspath(args.workdir)
    args.bed_dir = args.bed_dir or f"/tmp/shardio-bench-cpu-{os.getpid()}"
    args.child_timeout = args.timeout  # bench_pfs._prepare's name for it
    args.argv = list(argv)
    return args


def _choices(
    parser: argparse.ArgumentParser, opt: str, text: str, known: Sequence[str]
) -> list[str]:
    got = [t for t in text.split(",") if t]
    bad = [t for t in got if t not in known]
    if not got or bad or len(set(got)) != len(got):
        parser.error(f"{opt} takes a comma-separated subset of {', '.join(known)}, got '{text}'")
    return [k for k in known if k in got]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CPU benchmark and update RESULTS.md."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_floor"]:
        return _floor_child(argv[1:])
    if argv[:1] == ["_child"]:
        return _epoch_child(argv[1:])
    args = _parse(argv)
    common.hold_bench_lock(args.workdir)
    signal.signal(signal.SIGTERM, _sigterm)
    src = common.ensure_tree(
        REPO, args.workdir, files=args.files, classes=args.classes, mean_kb=args.mean_kb,
        regen=args.regen,
    )  # fmt: skip
    paths = bench_read._ensure_data(args, src)
    if any(c.data == "litdata" for c in args.configs):
        _ensure_litdata(args, src, paths)
    sizes = common.tree_payload(src)
    outcomes = [Outcome(c) for c in args.configs]
    args.cold_ok = True
    facts: dict[str, Any] = {
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_before": common.loadavg(),
        "code_before": common.code_state(REPO),
        "shards": _shards(paths["tar"]),
    }
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        args.base_tree = ""
        if args.baseline and any(c.base for c in args.configs):
            args.base_tree = stack.enter_context(baseline_tree(args.baseline, args.workdir))
        if "local" in args.fss:
            _rounds(outcomes, "local", paths, args, sizes)
        if "bed" in args.fss:
            facts["bed"] = _on_bed(outcomes, src, args, sizes)
    facts.update(
        elapsed_s=time.perf_counter() - t0,
        load_after=common.loadavg(),
        code_after=common.code_state(REPO),
        sizes=sizes,
    )
    body = cpu_report.report(outcomes, args, facts)
    common.publish(body, SECTION, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
