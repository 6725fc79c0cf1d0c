"""Fault-proof reading: what the safe transport, verification, repair and skipping cost.

One run, on one tar pack of bench_pack's ImageNet-like tree (``shardio pack --format tar``,
made once under ``--workdir`` and reused while its stamp stands), measures:

1. read throughput of ``ShardDataset(...).loader(batch_size=64, num_workers=2)`` with
   ``transport="ring"`` (reused shared memory, nothing mapped in the training process) against
   ``"mmap"`` (views of the workers' mappings) and ``"shm"`` (a fresh segment per batch), map
   and stream mode, warm and cold;
2. the cost of ``verify=True`` against ``verify=False`` (ring, warm, map and stream);
3. the time to repair one shard from the source: (a) reading the samples of one shard through
   ``ShardDataset(SRC, stage=DEST, recovery="raise")`` when its staged copy is
   silently damaged (re-staged on the first bad read) against the same reads of an intact
   copy; (b) ``shardio verify DEST --repair`` on that staging area against ``shardio verify
   DEST`` on the intact area;
4. an epoch through ``ShardDataset(..., recovery=RecoveryPolicy(policy="skip", ...))`` on a
   copy of the pack in which 1% of the shards (at least one) hold a flipped byte, against a
   clean epoch through the same wrapper, with the number of substituted samples.

The training loop makes every sample a ``bytes`` object. Each configuration runs in its own
child process, round-robin over ``--repeat-cold`` cold and ``--repeat-warm`` warm rounds;
the section "## Fault-proof reading" of benchmarks/RESULTS.md gets the medians. Not a test:
it measures and reports, and asserts nothing about speed.

Usage::

    sudo .venv/bin/python benchmarks/bench_faults.py [--files 20000] [--repeat-warm 3]
        [--repeat-cold 2] [--only NAME,...] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)
ME = os.path.abspath(__file__)
SECTION = "## Fault-proof reading"
BOTH = ("cold", "warm")
WARM = ("warm",)

TARGET_RING_VS_MMAP = 0.90  # the safe default within 10% of mapped views
TARGET_VERIFY_COST = 0.05  # verify=True at most 5% slower than verify=False
DAMAGED_FRACTION = 0.01  # of the shards, at least one, in the damaged copy
SKIP_OPTIONS = {"policy": "skip", "backoff_s": 0.0, "retries": 1}


# --------------------------------------------------------------------------------------------
# Configurations.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One measured configuration."""

    name: str
    label: str
    kind: str  # epoch: a loader epoch; shard: one shard's samples; verify: `shardio verify`
    caches: tuple[str, ...]
    data: str  # pack | damaged | stage: what it reads
    mode: str = "map"
    transport: str = "default"  # "default": the argument is not passed
    verify: bool = True
    resilient: bool = False  # epoch: through ResilientDataset (SKIP_OPTIONS)
    damaged: bool = False  # shard, verify: the staged copy is damaged just before


def _jobs() -> list[Job]:
    jobs = []
    for mode in ("map", "stream"):
        for transport in ("ring", "mmap", "shm"):
            jobs.append(
                Job(
                    f"{mode}-{transport}",
                    f"{mode}, transport={transport!r}",
                    "epoch",
                    BOTH,
                    "pack",
                    mode=mode,
                    transport=transport,
                )
            )
    for mode in ("map", "stream"):
        jobs.append(
            Job(
                f"{mode}-ring-noverify",
                f"{mode}, transport='ring', verify=False",
                "epoch",
                WARM,
                "pack",
                mode=mode,
                transport="ring",
                verify=False,
            )
        )
    for mode in ("map", "stream"):
        for data in ("pack", "damaged"):
            which = "clean" if data == "pack" else "damaged"
            jobs.append(
                Job(
                    f"resilient-{mode}-{which}",
                    f"ResilientDataset skip, {mode}, {which} pack",
                    "epoch",
                    WARM,
                    data,
                    mode=mode,
                    resilient=True,
                )
            )
    jobs += [
        Job("shard-intact", "shard's samples, intact staged copy", "shard", BOTH, "stage"),
        Job(
            "shard-damaged",
            "shard's samples, damaged staged copy (re-staged)",
            "shard",
            BOTH,
            "stage",
            damaged=True,
        ),
        Job("verify-intact", "`shardio verify DEST`, intact area", "verify", BOTH, "stage"),
        Job(
            "verify-repair",
            "`shardio verify DEST --repair`, one damaged copy",
            "verify",
            BOTH,
            "stage",
            damaged=True,
        ),
    ]
    return jobs


JOBS = _jobs()
BY_NAME = {j.name: j for j in JOBS}


# --------------------------------------------------------------------------------------------
# The children. ``_epoch``: one loader epoch; ``_shard``: one shard's samples through
# ResilientDataset with a staging area. Imports are done before READY (not timed).
# --------------------------------------------------------------------------------------------


def _epoch_child(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_faults.py _epoch")
    parser.add_argument("data")
    parser.add_argument("result")
    parser.add_argument("--mode", choices=("map", "stream"), default="map")
    parser.add_argument("--transport", default="default")
    parser.add_argument("--no-verify", dest="verify", action="store_false")
    parser.add_argument("--resilient", action="store_true")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--handshake", action="store_true")
    args = parser.parse_args(argv)
    import torch  # noqa: F401 - imported before the clock, as every user's script does

    from shardio import RecoveryPolicy, ShardDataset

    if args.handshake:
        common.child_handshake()  # the parent drops the caches here for a cold run
    t0 = time.perf_counter()
    options: dict[str, Any] = {"mode": args.mode, "seed": args.seed, "verify": args.verify}
    if args.transport != "default":
        options["transport"] = args.transport
    if args.resilient:
        options["recovery"] = RecoveryPolicy(**SKIP_OPTIONS)
    ds = ShardDataset(args.data, **options)
    loader = ds.loader(batch_size=args.batch_size, num_workers=args.workers)
    samples = nbytes = 0
    t_first: float | None = None
    for batch in loader:
        col = batch["jpeg"]
        for i in range(len(col)):
            payload = bytes(col[i])  # what a training loop that keeps the bytes does
            samples += 1
            nbytes += len(payload)
        if t_first is None:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    out = {
        "samples": samples,
        "bytes": nbytes,
        "time_s": t_end - t0,
        "first_batch_s": (t_first or t_end) - t0,
        "transport": getattr(ds, "transport", "?"),
        "recovery": dict(getattr(ds, "recovery_stats", {})),
    }
    with open(args.result, "w") as fh:
        json.dump(out, fh)
    return 0


def _shard_child(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_faults.py _shard")
    parser.add_argument("src")
    parser.add_argument("cache")
    parser.add_argument("result")
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--handshake", action="store_true")
    args = parser.parse_args(argv)
    import torch  # noqa: F401

    from shardio import ShardDataset

    if args.handshake:
        common.child_handshake()
    t0 = time.perf_counter()
    ds = ShardDataset(args.src, stage=args.cache, shuffle=False, recovery="raise")
    samples = nbytes = 0
    first_s = 0.0
    for i in range(args.first, args.first + args.count):
        t_read = time.perf_counter()
        payload = bytes(ds[i]["jpeg"])  # the first one finds the damage and re-stages
        if i == args.first:
            first_s = time.perf_counter() - t_read
        samples += 1
        nbytes += len(payload)
    t_end = time.perf_counter()
    out = {
        "samples": samples,
        "bytes": nbytes,
        "time_s": t_end - t0,
        "first_s": first_s,
        "recovery": dict(ds.recovery_stats),
        "cache": dict(ds.read_metrics().counts),
    }
    with open(args.result, "w") as fh:
        json.dump(out, fh)
    return 0


# --------------------------------------------------------------------------------------------
# The data: the tree, its tar pack, a damaged copy of the pack, a staging area.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Damage:
    """One flipped byte: in shard ``rel`` of a dataset or staging area, at ``offset``."""

    rel: str
    shard: int
    sample: int
    key: str
    offset: int
    original: int


@dataclass
class Data:
    """Paths and facts of the prepared data."""

    pack: str
    damaged: str
    stage: str
    num_samples: int
    payload: int
    shard_bytes: list[int]
    damage: list[Damage]  # in the damaged copy
    stage_damage: Damage  # the staged copy a shard/verify job damages
    stage_xxh3: str  # the staged shard's xxh3-128 (its stamp)
    shard_first: int  # the staged shard's samples
    shard_count: int
    backed_bytes: int  # memory touched and freed before each run (common.back_free_memory)
    commands: dict[str, str] = field(default_factory=dict)


def _shell(argv: Sequence[str]) -> str:
    return shlex.join(argv).replace(REPO + "/", "")


def _locate(pack: str, shard: int, which: str) -> Damage:
    """Where to flip a byte of shard ``shard``: the middle of the jpeg member of its first
    (``which="first"``) or middle sample."""
    from shardio.read.reader import ShardReader

    with ShardReader(pack) as ds:
        samples = [int(s) for s in (ds.index.samples["shard"] == shard).nonzero()[0]]
        sample = samples[0] if which == "first" else samples[len(samples) // 2]
        member = next(
            m
            for m in ds.index.sample_member_range(sample)
            if ds.index.exts[int(ds.index.members[m]["ext_id"])] == "jpeg"
        )
        rec = ds.index.members[member]
        offset = int(rec["offset"]) + int(rec["size"]) // 2
        rel = ds.manifest.shards[shard].path
        key = ds.key(sample)
    with open(os.path.join(pack, rel), "rb") as fh:
        fh.seek(offset)
        original = fh.read(1)[0]
    return Damage(rel=rel, shard=shard, sample=sample, key=key, offset=offset, original=original)


def _write_byte(path: str, offset: int, value: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(bytes([value]))


def _read_byte(path: str, offset: int) -> int | None:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            got = fh.read(1)
    except OSError:
        return None
    return got[0] if got else None


def _prepare(args: argparse.Namespace, src: str) -> Data:
    from shardio.read.reader import ShardReader

    base = os.path.join(
        args.workdir,
        f"faults-f{args.files}-kb{args.mean_kb:g}-c{args.classes}-s{args.shard_size}",
    )
    os.makedirs(base, exist_ok=True)
    pack, damaged, stage = (os.path.join(base, n) for n in ("tar", "damaged", "stage"))
    commands: dict[str, str] = {}
    pack_argv = [os.path.join(VENV_BIN, "shardio"), "pack", src, pack, "--format", "tar"]
    pack_argv += ["--shard-size", args.shard_size, "--no-progress"]
    commands["pack"] = _shell(pack_argv)
    if args.regen or not os.path.exists(pack + ".done"):
        for path in (pack, pack + ".done", damaged, damaged + ".done"):
            common.remove_path(path)
        print("preparing", _shell(pack_argv), file=sys.stderr)
        run = common.run_child(pack_argv)
        if run.returncode != 0:
            raise SystemExit(f"packing failed:\n{run.stderr_tail}")
        with open(pack + ".done", "w") as fh:
            fh.write(_shell(pack_argv) + "\n")

    with ShardReader(pack) as ds:
        shards = ds.manifest.shards
        shard_bytes = [int(s.size_bytes) for s in shards]
        n_shards = len(shards)
        num_samples = len(ds)
        sample_shards = ds.index.samples["shard"].tolist()
    payload = common.tree_payload(src)[1]

    # A copy of the pack with one flipped payload byte in 1% of its shards (at least one),
    # spread evenly; reused while its stamp (which names the flips) stands.
    n_bad = max(1, round(n_shards * DAMAGED_FRACTION))
    chosen = sorted({int((k + 0.5) * n_shards / n_bad) for k in range(n_bad)})
    damage: list[Damage] = []
    if os.path.exists(damaged + ".done"):
        with open(damaged + ".done") as fh:
            damage = [Damage(**d) for d in json.load(fh)]
        if [d.shard for d in damage] != chosen:
            damage = []
    if not damage:
        common.remove_path(damaged)
        common.remove_path(damaged + ".done")
        print(f"preparing a copy of the pack with shards {chosen} damaged", file=sys.stderr)
        shutil.copytree(pack, damaged)
        damage = [_locate(pack, s, "middle") for s in chosen]
        for d in damage:
            _write_byte(os.path.join(damaged, d.rel), d.offset, d.original ^ 0xFF)
        with open(damaged + ".done", "w") as fh:
            json.dump([d.__dict__ for d in damage], fh)

    # A fresh staging area for every run (re-staging and repair rewrite it).
    common.remove_path(stage)
    stage_argv = [os.path.join(VENV_BIN, "shardio"), "stage", pack, stage, "--no-progress"]
    commands["stage"] = _shell(stage_argv)
    print("preparing", _shell(stage_argv), file=sys.stderr)
    run = common.run_child(stage_argv)
    if run.returncode != 0:
        raise SystemExit(f"staging failed:\n{run.stderr_tail}")
    middle = n_shards // 2
    stage_damage = _locate(pack, middle, "first")
    firsts = [i for i in range(num_samples) if sample_shards[i] == middle]
    return Data(
        pack=pack,
        damaged=damaged,
        stage=stage,
        num_samples=num_samples,
        payload=payload,
        shard_bytes=shard_bytes,
        damage=damage,
        stage_damage=stage_damage,
        stage_xxh3=shards[middle].xxh3_128,
        shard_first=int(firsts[0]),
        shard_count=len(firsts),
        backed_bytes=sum(shard_bytes) + 256 * common.MiB,  # the epoch's pages and batches
        commands=commands,
    )


def _rot(data: Data) -> None:
    """Silent corruption of the staged copy (bit rot): flip the byte and refresh the stamp,
    so that the file's stat shows nothing and only a checksum can tell."""
    from shardio.staging.protocol import write_stamp

    d = data.stage_damage
    _write_byte(os.path.join(data.stage, d.rel), d.offset, d.original ^ 0xFF)
    write_stamp(data.stage, d.rel, data.stage_xxh3, False)


def _copy_intact(data: Data) -> bool:
    """Whether the staged copy holds the original byte and its stamp matches."""
    from shardio.staging.protocol import stamp_matches

    d = data.stage_damage
    return _read_byte(os.path.join(data.stage, d.rel), d.offset) == d.original and stamp_matches(
        data.stage, d.rel, data.stage_xxh3
    )


def _heal(data: Data) -> None:
    """Make the staged copy intact again if a repair did not (stage it again)."""
    if _copy_intact(data):
        return
    print(f"staged copy {data.stage_damage.rel} not intact: staging again", file=sys.stderr)
    argv = [os.path.join(VENV_BIN, "shardio"), "stage", data.pack, data.stage, "--no-progress"]
    run = common.run_child(argv)
    if run.returncode != 0 or not _copy_intact(data):
        raise SystemExit(f"cannot restore the staging area:\n{run.stderr_tail}")


# --------------------------------------------------------------------------------------------
# Measuring.
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One timed run."""

    time_s: float  # epoch/shard: measured in the child after its imports; verify: process wall
    wall_s: float
    first_s: float = 0.0  # shard: reading its first sample (with the damage: the repair)
    samples: int = 0
    nbytes: int = 0
    transport: str = ""
    recovery: dict[str, int] = field(default_factory=dict)
    cache: dict[str, int] = field(default_factory=dict)
    returncode: int = 0
    repaired: bool | None = None  # damaged jobs: was the staged copy intact afterwards


@dataclass
class Outcome:
    """All runs of one job."""

    job: Job
    warm: list[Run] = field(default_factory=list)
    cold: list[Run] = field(default_factory=list)
    status: str = "ok"  # ok | failed | unavailable
    note: str = ""

    def runs(self, cache: str) -> list[Run]:
        return self.warm if cache == "warm" else self.cold

    def time(self, cache: str) -> float | None:
        runs = self.runs(cache)
        return common.median([r.time_s for r in runs]) if runs else None

    def rate(self, cache: str) -> float | None:
        """Samples/s: median samples over median time."""
        runs = self.runs(cache)
        t = self.time(cache)
        if not runs or not t:
            return None
        return common.median([r.samples for r in runs]) / t


def _child_argv(job: Job, data: Data | None, result: str, args: argparse.Namespace) -> list[str]:
    """The command of a job (with placeholders when ``data`` is None)."""
    if job.kind == "verify":
        argv = [os.path.join(VENV_BIN, "shardio"), "verify", data.stage if data else "DEST"]
        return [*argv, *(["--repair"] if job.damaged else []), "--no-progress"]
    if job.kind == "shard":
        src, dest = (data.pack, data.stage) if data else ("SRC", "DEST")
        first, count = (str(data.shard_first), str(data.shard_count)) if data else ("F", "N")
        return [
            sys.executable,
            ME,
            "_shard",
            src,
            dest,
            result,
            "--first",
            first,
            "--count",
            count,
            "--handshake",
        ]
    where = (data.pack if job.data == "pack" else data.damaged) if data else job.data.upper()
    argv = [sys.executable, ME, "_epoch", where, result, "--mode", job.mode]
    argv += ["--transport", job.transport]
    if not job.verify:
        argv.append("--no-verify")
    if job.resilient:
        argv.append("--resilient")
    argv += ["--batch-size", str(args.batch_size), "--workers", str(args.workers)]
    return [*argv, "--seed", str(args.seed), "--handshake"]


def _measure(
    o: Outcome, cache: str, data: Data, args: argparse.Namespace, cold_ok: list[bool]
) -> None:
    job = o.job
    if job.kind in ("shard", "verify"):
        if job.damaged:
            _heal(data)
            _rot(data)
        else:
            _heal(data)
    if cache == "warm":
        if job.data == "stage":
            common.warm_up(data.pack, data.stage)
        else:
            common.warm_up(data.pack if job.data == "pack" else data.damaged)

    def drop() -> None:
        cold_ok[0] = common.drop_caches() and cold_ok[0]
        common.back_free_memory(data.backed_bytes)

    result_path = os.path.join(args.workdir, f"faults-result-{job.name}.json")
    common.remove_path(result_path)
    argv = _child_argv(job, data, result_path, args)
    result: dict[str, Any] = {}
    if cache == "warm":
        common.back_free_memory(data.backed_bytes)  # cold runs: after the drop
    if job.kind == "verify":
        if cache == "cold":
            drop()
        run = common.run_child(argv)
        ok = run.returncode in (0, 4) if job.damaged else run.returncode == 0
        if ok:  # 4: --repair fixed everything it found
            result = {"samples": 0, "bytes": 0, "time_s": run.wall_s}
    else:
        run = common.run_child(argv, on_ready=drop if cache == "cold" else (lambda: None))
        if run.returncode == 0 and os.path.exists(result_path):
            with open(result_path) as fh:
                result = json.load(fh)
    common.remove_path(result_path)
    if not result:
        o.status = "failed"
        o.note = f"exit {run.returncode}: " + " ".join(run.stderr_tail.strip().splitlines()[-3:])
        print(f"[{cache}] {job.name:24s} failed: {o.note}", file=sys.stderr)
        return
    got = Run(
        time_s=result["time_s"],
        wall_s=run.wall_s,
        first_s=result.get("first_s", 0.0),
        samples=result["samples"],
        nbytes=result["bytes"],
        transport=result.get("transport", ""),
        recovery=result.get("recovery", {}),
        stage=result.get("cache", {}),
        returncode=run.returncode,
        repaired=_copy_intact(data) if job.damaged else None,
    )
    o.runs(cache).append(got)
    extra = f" recovery={got.recovery}" if got.recovery else ""
    if got.repaired is not None:
        extra += f" repaired={got.repaired} rc={got.returncode}"
    rate = f"{got.samples / got.time_s:8.0f} samples/s" if got.samples else ""
    print(
        f"[{cache}] {job.name:24s} {got.time_s:7.3f} s {rate} n={got.samples}{extra} "
        f"load {common.loadavg()}",
        file=sys.stderr,
    )


# --------------------------------------------------------------------------------------------
# Reporting.
# --------------------------------------------------------------------------------------------


def _verdict(ok: bool) -> str:
    return "**PASS**" if ok else "**FAIL**"


def _spread(runs: Sequence[Run]) -> str:
    times = [r.time_s for r in runs]
    return f"{common.median(times):.2f} ({min(times):.2f}-{max(times):.2f})"


def _get(outcomes: Sequence[Outcome], name: str) -> Outcome | None:
    for o in outcomes:
        if o.job.name == name and o.status == "ok":
            return o
    return None


def _ratio(a: Outcome | None, b: Outcome | None, cache: str) -> float | None:
    ra = a.rate(cache) if a else None
    rb = b.rate(cache) if b else None
    return ra / rb if ra and rb else None


def _cells(o: Outcome | None, cache: str, payload_per_sample: float) -> list[str]:
    if o is None or not o.runs(cache):
        return ["-", "-", "-"]
    rate = o.rate(cache)
    assert rate is not None
    return [_spread(o.runs(cache)), f"{rate:,.0f}", f"{rate * payload_per_sample / 1e6:,.0f}"]


def _transport_section(outcomes: Sequence[Outcome], per_sample: float) -> tuple[str, list[str]]:
    rows, targets = [], []
    for mode in ("map", "stream"):
        mmap = _get(outcomes, f"{mode}-mmap")
        for transport in ("ring", "mmap", "shm"):
            o = _get(outcomes, f"{mode}-{transport}")
            row = [mode, f"`{transport}`"]
            for cache in ("warm", "cold"):
                r = _ratio(o, mmap, cache)
                row += [*_cells(o, cache, per_sample), common.fmt_ratio(r) if r else "-"]
            rows.append(row)
        ring = _get(outcomes, f"{mode}-ring")
        for cache in ("warm", "cold"):
            r = _ratio(ring, mmap, cache)
            targets.append(
                f"- {mode} mode, {cache}: ring ≥ {TARGET_RING_VS_MMAP:.2f}x mmap: "
                + (f"{r:.2f}x → {_verdict(r >= TARGET_RING_VS_MMAP)}" if r else "not measured")
            )
    header = ["mode", "transport"]
    for cache in ("warm", "cold"):
        header += [f"{cache} s, median (min-max)", f"{cache} samples/s", f"{cache} MB/s"]
        header.append(f"{cache} vs mmap")
    return common.markdown_table(header, rows), targets


def _verify_section(outcomes: Sequence[Outcome], per_sample: float) -> tuple[str, list[str]]:
    rows, targets = [], []
    for mode in ("map", "stream"):
        on, off = _get(outcomes, f"{mode}-ring"), _get(outcomes, f"{mode}-ring-noverify")
        r = _ratio(off, on, "warm")
        cost = r - 1 if r else None
        rows.append(
            [
                mode,
                *_cells(on, "warm", per_sample),
                *_cells(off, "warm", per_sample),
                f"{cost:+.1%}" if cost is not None else "-",
            ]
        )
        targets.append(
            f"- {mode} mode, warm: verify=True at most {TARGET_VERIFY_COST:.0%} slower than "
            "verify=False: "
            + (
                f"{cost:+.1%} → {_verdict(cost <= TARGET_VERIFY_COST)}"
                if cost is not None
                else "not measured"
            )
        )
    header = ["mode (ring, warm)", "verify=True s, median (min-max)", "samples/s", "MB/s"]
    header += ["verify=False s, median (min-max)", "samples/s", "MB/s", "cost of verifying"]
    return common.markdown_table(header, rows), targets


def _intact_after(runs: Sequence[Run]) -> str:
    return f"{sum(bool(r.repaired) for r in runs)}/{len(runs)}" if runs else "-"


def _med(runs: Sequence[Run], attr: str) -> float | None:
    return common.median([getattr(r, attr) for r in runs]) if runs else None


def _restage_section(outcomes: Sequence[Outcome], data: Data) -> tuple[str, list[str]]:
    """(a): a shard's samples through ResilientDataset, staged copy intact or damaged."""
    rows, lines = [], []
    intact, damaged = _get(outcomes, "shard-intact"), _get(outcomes, "shard-damaged")
    for o in (intact, damaged):
        if o is None:
            continue
        row = [o.job.label]
        for cache in ("warm", "cold"):
            runs = o.runs(cache)
            first = sorted(r.first_s * 1e3 for r in runs)
            row += [
                _spread(runs) if runs else "-",
                f"{common.median(first):.1f} ({first[0]:.1f}-{first[-1]:.1f})" if runs else "-",
            ]
        runs = o.warm + o.cold
        row.append(", ".join(str(r.recovery.get("restage", 0)) for r in runs) or "-")
        row.append(_intact_after(runs) if o.job.damaged else "-")
        rows.append(row)
    shard_mb = data.shard_bytes[data.stage_damage.shard] / 1e6
    for cache in ("warm", "cold"):
        a = _med(intact.runs(cache), "first_s") if intact else None
        b = _med(damaged.runs(cache), "first_s") if damaged else None
        ta = intact.time(cache) if intact else None
        tb = damaged.time(cache) if damaged else None
        if a is None or b is None or ta is None or tb is None:
            continue
        lines.append(
            f"- {cache}: repairing the {shard_mb:.1f} MB shard (first sample, damaged - intact, "
            f"medians) took {(b - a) * 1e3:.0f} ms ({shard_mb / max(b - a, 1e-9):,.0f} MB/s "
            f"of shard); the whole shard's samples {tb - ta:+.3f} s against the intact copy."
        )
    header = ["staged copy (one shard: " + f"{shard_mb:.1f} MB)", "warm s, median (min-max)"]
    header += ["warm first sample ms", "cold s, median (min-max)", "cold first sample ms"]
    header += ["re-staged (per run)", "copy intact after"]
    return common.markdown_table(header, rows), lines


def _verify_repair_section(outcomes: Sequence[Outcome]) -> tuple[str, list[str]]:
    """(b): `shardio verify DEST` (intact) against `shardio verify DEST --repair` (damaged)."""
    rows, lines = [], []
    header = ["command", "warm s, median (min-max)", "cold s, median (min-max)"]
    header += ["exit codes (per run)", "copy intact after"]
    intact, repair = _get(outcomes, "verify-intact"), _get(outcomes, "verify-repair")
    for name in ("verify-intact", "verify-repair"):
        o = _get(outcomes, name)
        job = BY_NAME[name]
        if o is None:
            status = next((x.status for x in outcomes if x.job.name == name), "not run")
            rows.append([job.label, status, "-", "-", "-"])
            continue
        runs = o.warm + o.cold
        rows.append(
            [
                job.label,
                _spread(o.warm) if o.warm else "-",
                _spread(o.cold) if o.cold else "-",
                ", ".join(str(r.returncode) for r in runs),
                _intact_after(runs) if job.damaged else "-",
            ]
        )
    for cache in ("warm", "cold"):
        if intact is None or repair is None or not intact.runs(cache) or not repair.runs(cache):
            continue
        diff = (repair.time(cache) or 0.0) - (intact.time(cache) or 0.0)
        plain = [r.time_s for r in intact.runs(cache)]
        repaired = [r.time_s for r in repair.runs(cache)]
        if min(repaired) > max(plain):
            verdict = "every `--repair` run took longer than every plain run"
        else:
            verdict = (
                "the two commands' run times overlap, so this run does not resolve the repair "
                "of one shard within a whole-area verification"
            )
        lines.append(
            f"- {cache}: `--repair` with one damaged copy minus `verify` of the intact area, "
            f"medians: {diff:+.3f} s ({verdict})."
        )
    return common.markdown_table(header, rows), lines


def _skip_section(outcomes: Sequence[Outcome], per_sample: float) -> str:
    rows = []
    for mode in ("map", "stream"):
        clean = _get(outcomes, f"resilient-{mode}-clean")
        for which in ("clean", "damaged"):
            o = _get(outcomes, f"resilient-{mode}-{which}")
            runs = o.warm if o else []
            r = _ratio(o, clean, "warm")
            subs = ", ".join(str(x.recovery.get("skip", 0)) for x in runs) if runs else "-"
            rows.append(
                [
                    mode,
                    which,
                    *_cells(o, "warm", per_sample),
                    common.fmt_ratio(r) if r else "-",
                    subs,
                ]
            )
    header = ["mode", "pack", "warm s, median (min-max)", "samples/s", "MB/s", "vs clean"]
    header.append("substituted samples (per run)")
    return common.markdown_table(header, rows)


def _report(
    outcomes: Sequence[Outcome], data: Data, args: argparse.Namespace, info: dict[str, Any]
) -> str:
    per_sample = data.payload / data.num_samples
    transport_table, transport_targets = _transport_section(outcomes, per_sample)
    verify_table, verify_targets = _verify_section(outcomes, per_sample)
    restage_table, restage_lines = _restage_section(outcomes, data)
    repair_table, repair_lines = _verify_repair_section(outcomes)
    skip_table = _skip_section(outcomes, per_sample)
    n_shards = len(data.shard_bytes)
    default_transport = sorted(
        {
            r.transport
            for o in outcomes
            if o.job.kind == "epoch" and o.job.transport == "default"
            for r in o.warm + o.cold
        }
    )
    notes = [f"- {o.job.label}: {o.status} — {o.note}" for o in outcomes if o.status != "ok"]
    for o in outcomes:
        if o.job.damaged and o.status == "ok" and not all(r.repaired for r in o.warm + o.cold):
            notes.append(f"- {o.job.label}: the staged copy was not intact after every run")
    for o in outcomes:
        if o.job.kind != "epoch" or o.status != "ok":
            continue
        for r in o.warm + o.cold:
            if r.samples != data.num_samples or (not o.job.resilient and r.nbytes != data.payload):
                notes.append(
                    f"- {o.job.label}: delivered {r.samples} samples / {r.nbytes} bytes (the "
                    f"tree has {data.num_samples} / {data.payload})"
                )
                break
    raw = []
    for o in outcomes:
        for cache in ("cold", "warm"):
            if o.runs(cache):
                raw.append(
                    f"- {o.job.name} {cache}: "
                    + ", ".join(f"{r.time_s:.3f}/{r.wall_s:.1f}" for r in o.runs(cache))
                )
    cache_line = (
        "cold runs: `sync; echo 3 > /proc/sys/vm/drop_caches` after the child's imports, just "
        "before it starts the clock (for `shardio verify`: just before the process)"
        if info["cold"]
        else "**cold runs are not cold**: dropping caches was not permitted (not root)"
    )
    versions = ", ".join(
        f"{n} {common.package_version(n)}" for n in ("shardio", "torch", "numpy", "xxhash")
    )
    argv = [".venv/bin/python", "benchmarks/bench_faults.py", "--files", str(args.files)]
    argv += ["--repeat-warm", str(args.repeat_warm), "--repeat-cold", str(args.repeat_cold)]
    if args.only:
        argv += ["--only", args.only]
    d = data.stage_damage
    bad = ", ".join(f"{x.rel} (sample {x.key!r})" for x in data.damage)
    shard_mb = [b / 1e6 for b in data.shard_bytes]
    children = sorted(
        {_shell(_child_argv(o.job, None, "RESULT", args)) for o in outcomes},
        key=lambda s: s,
    )
    parts = [
        f"Run {info['started']}; {versions}.",
        "",
        info["code"],
        "",
        f"Data: the bench_pack tree (`scripts/gen_imagenet.py --files {args.files} --classes "
        f"{args.classes} --mean-kb {args.mean_kb:g}`), {data.num_samples} JPEGs, "
        f"{data.payload / 1e9:.3f} GB of payload, packed once with `{data.commands['pack']}` "
        f"into {n_shards} tar shards ({sum(data.shard_bytes) / 1e9:.3f} GB; "
        f"{min(shard_mb):.1f}-{max(shard_mb):.1f} MB each). A DataLoader with {args.workers} "
        f"workers, batch size {args.batch_size}, through `ds.loader(...)`; the training loop "
        "makes every sample a `bytes` object (`bytes(batch['jpeg'][i])` for each i) and "
        "decodes nothing. Each configuration is its own child process; runs are round-robin "
        f"over the configurations, {args.repeat_cold} cold then {args.repeat_warm} warm "
        f"rounds interleaved; {cache_line}. Warm runs follow a read of all the files the "
        f"configuration reads. Before every run {data.backed_bytes / 2**30:.1f} GiB of memory "
        "is touched and freed (after the drop for cold runs): this VM hands free memory back "
        "to its host (see `back_free_memory` in benchmarks/common.py). Time = building the "
        "dataset and loader + reading, from after "
        f"the imports to the last sample; MB/s = 10^6 bytes of JPEG payload. Load average "
        f"before / after: {info['load'][0]} / {info['load'][1]} (2 CPUs; other sessions may "
        f"be running); measuring took {info['elapsed']:.0f} s.",
        "",
        "### 1. Transports",
        "",
        "`ShardDataset(pack, mode=M, transport=T, seed=0).loader(batch_size="
        f"{args.batch_size}, num_workers={args.workers})`. `ring`: workers verify each batch "
        "into reused shared-memory slots allocated once per iteration (nothing mapped in the "
        "training process); `mmap`: workers verify through their mapping of the shard and send "
        "(file, offset, size), the training process views the same page-cache pages; `shm`: a "
        "fresh shared-memory segment per batch.",
        "",
        transport_table,
        "",
        "### 2. Verification",
        "",
        "The same runs as `ring` above (warm) against `verify=False`; cost = samples/s "
        "without / samples/s with - 1.",
        "",
        verify_table,
        "",
        "### 3. Repairing one shard from the source",
        "",
        f"A staging area made by `{data.commands['stage']}` (fresh for each benchmark run). "
        f"Damage = silent corruption of the staged copy of {d.rel} (shard {d.shard}, "
        f"{data.shard_count} samples): one byte of the jpeg member of its first sample "
        f"{d.key!r} flipped and the copy's stamp refreshed, so that its stat shows nothing "
        "(bit rot: only a checksum can tell); done again before every damaged run. 'Copy "
        "intact after': the flipped byte is back and the stamp matches.",
        "",
        "(a) Reading that shard's samples, `ds[i]` in order in one process, through "
        "`ShardDataset(SRC, stage=DEST, shuffle=False, recovery='raise')`. "
        "With the damage, the first read fails its checksum and the copy is staged again "
        "from SRC (copied and verified under its lock), then read: the first sample's time "
        "is the repair. The rest of the shard then comes from the fresh copy in the page "
        "cache, which is why the whole shard can take less time cold than reading the intact "
        "copy sample by sample from disk.",
        "",
        restage_table,
        "",
        *restage_lines,
        "",
        "(b) Process wall of `shardio verify DEST` on the intact area and of `shardio verify "
        "DEST --repair` with the copy damaged (exit code 4: it repaired everything it found); "
        "both read every staged shard, so their difference is the repair.",
        "",
        repair_table,
        "",
        *repair_lines,
        "",
        "### 4. An epoch with 1% of the shards damaged",
        "",
        f"A copy of the pack in which {len(data.damage)} of {n_shards} shards "
        f"({len(data.damage) / n_shards:.1%}) hold one flipped byte, in the jpeg member of "
        f"their middle sample: {bad}. Both rows read through "
        "`ShardDataset(pack, mode=M, seed=0, recovery=RecoveryPolicy(policy='skip', "
        "backoff_s=0.0, retries=1))` with the default transport ("
        + (", ".join(f"`{t}`" for t in default_transport) or "?")
        + "), warm; a damaged sample is retried once, then replaced by a substitute drawn from "
        "the same rank's share of the epoch.",
        "",
        skip_table,
        "",
        "Targets:",
        "",
        *transport_targets,
        *verify_targets,
    ]
    if notes:
        parts += ["", "Notes:", "", *notes]
    parts += [
        "",
        "Raw times (s; measured time / process wall), in run order:",
        "",
        *raw,
        "",
        "Reproduce (root, for drop_caches):",
        "",
        "```",
        shlex.join(argv),
        "```",
        "",
        "Each child (PACK = the pack, DAMAGED = its damaged copy, SRC = PACK, DEST = the "
        "staging area):",
        "",
        "```",
        *children,
        "```",
    ]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------
# Main.
# --------------------------------------------------------------------------------------------


def _repair_available() -> bool:
    """Whether ``shardio verify`` has ``--repair`` (it is recent)."""
    out = subprocess.run(
        [os.path.join(VENV_BIN, "shardio"), "verify", "--help"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return "--repair" in out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the fault benchmark and update RESULTS.md."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_epoch"]:
        return _epoch_child(argv[1:])
    if argv[:1] == ["_shard"]:
        return _shard_child(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20000)
    parser.add_argument("--mean-kb", type=float, default=110.0)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--repeat-warm", type=int, default=3)
    parser.add_argument("--repeat-cold", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shard-size",
        default="20MiB",
        help="about 100 shards at the default size, so that 1%% of them is one shard",
    )
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--regen", action="store_true", help="regenerate the tree and the pack")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(argv)
    args.workdir = os.path.abspath(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)
    common.hold_bench_lock(args.workdir)

    jobs = list(JOBS)
    jobs = common.select_named(parser, args.only, jobs)

    src = common.ensure_tree(
        REPO,
        args.workdir,
        files=args.files,
        classes=args.classes,
        mean_kb=args.mean_kb,
        regen=args.regen,
    )
    data = _prepare(args, src)
    outcomes = [Outcome(j) for j in jobs]
    if not _repair_available():
        for o in outcomes:
            if o.job.name == "verify-repair":
                o.status, o.note = "unavailable", "`shardio verify --help` lists no --repair"

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
                if o.status == "ok" and cache in o.job.caches:
                    _measure(o, cache, data, args, cold_ok)
    elapsed = time.perf_counter() - t0
    print(f"measured in {elapsed:.0f} s", file=sys.stderr)
    info = {
        "started": started,
        "load": (load_before, common.loadavg()),
        "elapsed": elapsed,
        "cold": cold_ok[0],
        "code": common.code_line(code_before, common.code_state(REPO), "read"),
    }
    body = _report(outcomes, data, args, info)
    common.publish(body, SECTION, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
