"""bench_pfs.py's pinned part: the bed on some CPUs, the readers on the others, and the ceiling.

On a small machine the MooseFS bed's own daemons (master, chunkservers, FUSE client) take a
large share of the CPUs, so an unpinned epoch measures who wins the CPU. Here the bed runs on
``--bed-cpus`` (``moosefs.sh up --cpus``) and every measured child (the readers, their
DataLoader workers, ``cat``) under ``taskset -c READER_CPUS``, so readers compare on equal
CPU. Beside ``cat`` it measures the raw ceiling of map mode's access pattern: a child that
preads every sample's members of the shardio tar shards in the epoch order map mode uses
(``ShardDataset(mode="map", seed=S).epoch_order()``, the batches dealt to as many worker
processes as the DataLoader has, as the DataLoader deals them), with no checksum and no
hand-off to a training process. Per run it records the reader's wall time, the reader's
CPU-seconds (its process tree, from the READY handshake to the end) and the bed's
CPU-seconds (``/proc/PID/stat`` of its daemons) over the same span.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import common

SECTION = "## On a parallel filesystem, pinned: bed and readers on separate CPUs"
TARGET_STREAM_VS_CAT = 0.90
TARGET_MAP_VS_CAT = 0.70
TARGET_VS_CEILING = 0.90
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------------------------
# CPU lists and the bed's processes.
# --------------------------------------------------------------------------------------------


def online_cpus() -> set[int]:
    """The online CPUs, from /sys/devices/system/cpu/online."""
    with open("/sys/devices/system/cpu/online") as fh:
        return parse_cpu_list(fh.read().strip(), None)


def parse_cpu_list(text: str, online: set[int] | None) -> set[int]:
    """A taskset CPU list (``1``, ``0-1``, ``0,2-3``) as a set, every CPU in ``online``.

    Raises:
        ValueError: empty, malformed, a backwards range or a CPU not online (one line).
    """
    if not text or len(text) > 200:
        raise ValueError(f"'{text}' is empty or too long")
    cpus: set[int] = set()
    for item in text.split(","):
        lo, dash, hi = item.partition("-")
        if not (lo.isdigit() and lo.isascii() and len(lo) <= 4) or (
            dash and not (hi.isdigit() and hi.isascii() and len(hi) <= 4)
        ):
            raise ValueError(f"'{text}' is malformed at '{item}'")
        first, last = int(lo), int(hi) if dash else int(lo)
        if first > last:
            raise ValueError(f"'{text}': the range '{item}' runs backwards")
        cpus.update(range(first, last + 1))
    missing = sorted(cpus - online) if online is not None else []
    if missing:
        raise ValueError(f"'{text}': CPU {missing[0]} is not online")
    return cpus


def bed_pids(netns: str) -> dict[int, str]:
    """The bed's daemons (pid: name): the mfs* processes in its network namespace (the
    master, the chunkservers, and the client, which moosefs.sh starts there)."""
    out = subprocess.run(
        ["ip", "netns", "pids", netns], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    found: dict[int, str] = {}
    for pid in sorted(int(p) for p in out.split()):
        try:
            with open(f"/proc/{pid}/comm") as fh:
                comm = fh.read().strip()
        except OSError:
            continue
        if comm.startswith("mfs"):
            found[pid] = comm
    return found


def allowed_lists(pid: int) -> set[str]:
    """Every thread's Cpus_allowed_list of ``pid`` (one value when all agree)."""
    lists: set[str] = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return lists
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as fh:
                for line in fh:
                    if line.startswith("Cpus_allowed_list:"):
                        lists.add(line.split(":", 1)[1].strip())
        except OSError:
            continue
    return lists


def cpu_s(pid: int, *, reaped: bool = False) -> float:
    """CPU-seconds of ``pid`` (all its threads; with ``reaped``, also the children it has
    waited for), from /proc/PID/stat; 0.0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    if reaped:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / CLK_TCK


def process_cpu_s() -> float:
    """CPU-seconds of this process (all threads), the children it reaped and those alive."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    return total + sum(tree_cpu_s(kid) for kid in common.child_pids(os.getpid()))


def with_epoch_cpu(run: Callable[[], int], result: str) -> int:
    """Run an epoch child (``run``, which calls ``common.child_handshake``) and add to its
    result JSON ``cpu_s``: the CPU-seconds of the child and all its processes from the
    handshake's GO to the epoch's end (before the interpreter's own teardown, which with
    torch loaded takes ~0.4 CPU-s here and is no part of an epoch)."""
    mark: dict[str, float] = {}
    original = common.child_handshake

    def handshake() -> None:
        original()
        mark["go"] = process_cpu_s()

    common.child_handshake = handshake
    try:
        rc = run()
    finally:
        common.child_handshake = original
    if rc == 0 and "go" in mark and os.path.exists(result):
        with open(result) as fh:
            data = json.load(fh)
        data["cpu_s"] = process_cpu_s() - mark["go"]
        with open(result, "w") as fh:
            json.dump(data, fh)
    return rc


def tree_cpu_s(pid: int) -> float:
    """CPU-seconds of ``pid`` and its live descendants."""
    total = cpu_s(pid, reaped=True)
    for kid in common.child_pids(pid):
        total += tree_cpu_s(kid)
    return total


# --------------------------------------------------------------------------------------------
# Measuring: every child under ``taskset -c READER_CPUS``, CPU of the reader and of the bed.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reader:
    """One measured configuration, as bench_pfs.py builds it."""

    name: str
    label: str
    order: str
    argv: list[str]  # unpinned; a handshake child's argv ends with --handshake
    data: str  # read once before a warm run
    result: str = ""  # the child's result JSON ("" for `cat`: its time is the wall time)
    env: dict[str, str] | None = None


@dataclass
class Run:
    """One epoch of one reader."""

    time_s: float
    reader_cpu_s: float
    bed_cpu_s: float
    samples: int
    nbytes: int


@dataclass
class Tally:
    """All runs of one reader."""

    reader: Reader
    runs: dict[str, list[Run | None]] = field(default_factory=lambda: {"cold": [], "warm": []})
    status: str = "ok"  # ok | failed | unavailable
    note: str = ""
    allowed: set[str] = field(default_factory=set)  # Cpus_allowed_list seen in its tree

    def ok(self, cache: str) -> list[Run]:
        return [r for r in self.runs[cache] if r is not None]


class _TreeWatch:
    """Samples the child's process tree while it runs: every thread's Cpus_allowed_list."""

    def __init__(self, interval_s: float = 0.25) -> None:
        import threading

        self.interval_s = interval_s
        self.allowed: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pinned-watch", daemon=True)

    def _walk(self, pid: int) -> None:
        self.allowed |= allowed_lists(pid)
        for kid in common.child_pids(pid):
            self._walk(kid)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            for kid in common.child_pids(os.getpid()):
                self._walk(kid)

    def __enter__(self) -> _TreeWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _epoch(
    tally: Tally,
    cache: str,
    *,
    reader_cpus: str,
    bed: dict[int, str],
    timeout_s: float,
    num_samples: int,
    payload: int,
    peer_unavailable: int,
) -> None:
    rd = tally.reader
    if tally.status != "ok":
        tally.runs[cache].append(None)
        return
    cold = cache == "cold"
    if not cold:
        common.warm_up(rd.data)
    if rd.result:
        common.remove_path(rd.result)
    snap: dict[str, float] = {}

    def bed_cpu() -> float:
        return sum(cpu_s(pid) for pid in bed)

    def ready() -> None:  # the child has imported what it needs: its reading starts now
        if cold:
            common.drop_caches()
        snap["reader0"] = sum(tree_cpu_s(k) for k in common.child_pids(os.getpid()))
        snap["bed0"] = bed_cpu()

    handshake = bool(rd.result)
    if not handshake:  # `cat`: no imports, the whole process is the read
        ready()
    with _TreeWatch() as watch:
        run = common.run_child(
            ["taskset", "-c", reader_cpus, *rd.argv],
            env=rd.env,
            on_ready=ready if handshake else None,
            timeout_s=timeout_s,
        )
    bed_used = bed_cpu() - snap.get("bed0", 0.0)
    tally.allowed |= watch.allowed
    result: dict[str, Any] | None = None
    if run.returncode == 0 and not handshake:
        result = {"samples": num_samples, "bytes": payload, "time_s": run.wall_s}
    elif run.returncode == 0 and os.path.exists(rd.result):
        with open(rd.result) as fh:
            result = json.load(fh)
        common.remove_path(rd.result)
    if result is None:
        tally.status = "unavailable" if run.returncode == peer_unavailable else "failed"
        lines = [ln for ln in run.stderr_tail.strip().splitlines() if ln.strip()]
        why = "timed out" if run.timed_out else f"exit {run.returncode}"
        tally.note = f"{why}: {lines[-1].strip()[:200] if lines else '(no message)'}"
        tally.runs[cache].append(None)
        print(f"[pinned {cache}] {rd.name:22s} {tally.status}: {tally.note}", file=sys.stderr)
        return
    if "cpu_s" in result:  # the child's own count, from GO to the epoch's end
        reader_used = float(result["cpu_s"])
    else:  # `cat`: wait4 of the whole process (no imports, no interpreter to tear down)
        reader_used = run.user_s + run.sys_s - snap.get("reader0", 0.0)
    one = Run(result["time_s"], reader_used, bed_used, result["samples"], result["bytes"])
    tally.runs[cache].append(one)
    print(
        f"[pinned {cache}] {rd.name:22s} {one.time_s:6.2f} s "
        f"{one.nbytes / 1e6 / one.time_s:6.0f} MB/s n={one.samples} reader {one.reader_cpu_s:5.2f}"
        f" CPU-s, bed {one.bed_cpu_s:5.2f} CPU-s, load {common.loadavg()}",
        file=sys.stderr,
    )


def measure(
    readers: Sequence[Reader],
    *,
    rounds: int,
    reader_cpus: str,
    bed: dict[int, str],
    timeout_s: float,
    num_samples: int,
    payload: int,
    peer_unavailable: int,
) -> tuple[list[Tally], list[str]]:
    """``rounds`` rounds (cold, then warm; the readers' order rotated each round); returns
    the tallies and the load average at the start of each round. This process runs on the
    reader CPUs meanwhile, so that its own sampling stays off the bed's CPUs."""
    tallies = [Tally(r) for r in readers]
    loads: list[str] = []
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, parse_cpu_list(reader_cpus, None))
    try:
        for r in range(rounds):
            loads.append(common.loadavg())
            shift = r % len(tallies)
            for cache in ("cold", "warm"):
                for tally in tallies[shift:] + tallies[:shift]:
                    _epoch(
                        tally,
                        cache,
                        reader_cpus=reader_cpus,
                        bed=bed,
                        timeout_s=timeout_s,
                        num_samples=num_samples,
                        payload=payload,
                        peer_unavailable=peer_unavailable,
                    )
    finally:
        os.sched_setaffinity(0, before)
    return tallies, loads


# --------------------------------------------------------------------------------------------
# The report.
# --------------------------------------------------------------------------------------------


def _ratio(t: Tally, ref: Tally | None, cache: str) -> float | None:
    """Median over rounds of ref's time / t's time in the same round."""
    if ref is None:
        return None
    pairs = [
        a.time_s / b.time_s
        for a, b in zip(ref.runs[cache], t.runs[cache], strict=False)
        if a is not None and b is not None
    ]
    return common.median(pairs) if pairs else None


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _med(runs: list[Run], what: Callable[[Run], float]) -> float | None:
    return common.median([what(r) for r in runs]) if runs else None


def verdicts(tallies: Sequence[Tally]) -> list[str]:
    """The issue's targets on the pinned bed, one PASS/FAIL line each."""
    by = {t.reader.name: t for t in tallies}
    cat, ceiling = by.get("cat-shards"), by.get("ceiling")
    out: list[str] = []

    def line(what: str, value: float | None, target: float) -> bool | None:
        ok = None if value is None else value >= target
        verdict = "n/a" if ok is None else ("PASS" if ok else "FAIL")
        # Three decimals: 0.897 must not read as 0.90 beside a FAIL.
        out.append(f"- {what} ≥ {target:.2f}x: {_fmt(value, '.3f', 'x')} → **{verdict}**")
        return ok

    # Each mode: its target against `cat`, or (the other form) against the raw
    # random-read ceiling measured on the same pinned CPU.
    modes = (
        ("stream", by.get("shardio-stream-auto"), TARGET_STREAM_VS_CAT),
        ("map", by.get("shardio-map-auto"), TARGET_MAP_VS_CAT),
    )
    for mode, tally, vs_cat in modes:
        if tally is None:
            continue
        a = line(f"shardio {mode}, cold, vs `cat`", _ratio(tally, cat, "cold"), vs_cat)
        b = line(
            f"shardio {mode}, cold, vs the raw random-read ceiling",
            _ratio(tally, ceiling, "cold"),
            TARGET_VS_CEILING,
        )
        if a is not None or b is not None:
            out.append(
                f"- {mode} mode, either target (vs `cat`, or vs the ceiling): "
                f"**{'PASS' if a or b else 'FAIL'}**"
            )
    return out


def report(tallies: Sequence[Tally], loads: Sequence[str], facts: dict[str, Any]) -> str:
    """The section's body (markdown)."""
    by = {t.reader.name: t for t in tallies}
    cat, ceiling = by.get("cat-shards"), by.get("ceiling")
    lines = [
        f"{facts['files']:,} files of ~{facts['mean_kb']:g} KB ({facts['payload'] / 1e6:.0f} MB "
        f"of JPEG payload; {facts['shards']} shardio tar shards, "
        f"{facts['shard_bytes'] / 1e6:.0f} MB) on a private MooseFS bed "
        f"(`{facts['bed_argv']}`; {facts['mfs_version']}) whose master, chunkservers and "
        f"FUSE client run on CPU(s) **{facts['bed_cpus']}** only (`moosefs.sh up --cpus`: "
        f"each daemon started under `taskset -c`), while every measured child (the readers, "
        f"their DataLoader workers, `cat`, the ceiling) runs under `taskset -c "
        f"{facts['reader_cpus']}`. Batch size {facts['batch_size']}, {facts['workers']} "
        f"workers, bytes only. Median of {facts['rounds']} rounds, each cold (caches dropped "
        "after the child's imports) then warm.",
        "",
        "Pinning as measured from `/proc/PID/task/*/status` (`Cpus_allowed_list` of every thread):",
        "",
    ]
    rows = [[comm, str(pid), ", ".join(sorted(facts["bed_allowed"].get(pid, set())))]
            for pid, comm in sorted(facts["bed_pids"].items())]  # fmt: skip
    lines += [common.markdown_table(["bed process", "pid", "Cpus_allowed_list"], rows), ""]
    seen = sorted({a for t in tallies for a in t.allowed})
    lines.append(
        "Readers' processes and threads, sampled every 0.25 s while they ran: "
        f"`Cpus_allowed_list` {', '.join(seen) if seen else '(none sampled)'}."
    )
    lines += ["", f"### One epoch from the mount, pinned (median of {facts['rounds']} rounds)", ""]
    rows = []
    for t in tallies:
        row = [t.reader.label, t.reader.order]
        for cache in ("cold", "warm"):
            runs = t.ok(cache)
            row += [
                _fmt(_med(runs, lambda r: r.time_s)),
                _fmt(_ratio(t, cat, cache), ".2f", "x"),
                _fmt(_ratio(t, ceiling, cache), ".2f", "x"),
                _fmt(_med(runs, lambda r: r.reader_cpu_s)),
                _fmt(_med(runs, lambda r: r.bed_cpu_s)),
            ]
        cold = t.ok("cold")
        row.append(_fmt(_med(cold, lambda r: r.nbytes / 1e6 / r.time_s), ".0f"))
        row.append(
            f"{t.status}: {t.note}"
            if t.status != "ok"
            else "; ".join(
                f"{c} " + ", ".join(f"{r.time_s:.2f}" for r in t.ok(c)) for c in ("cold", "warm")
            )
        )
        rows.append(row)
    header = ["reader", "order"]
    for cache in ("cold", "warm"):
        header += [
            f"{cache} s",
            f"{cache} vs cat",
            f"{cache} vs ceiling",
            f"{cache} reader CPU-s",
            f"{cache} bed CPU-s",
        ]
    header += ["cold MB/s", "times s (or why not)"]
    lines += [common.markdown_table(header, rows), ""]
    lines += [
        '"vs cat" / "vs ceiling": in each round, the time of `cat` of the tar shards (or of the '
        "ceiling) over the reader's time, median over rounds. Times are set-up plus the epoch, "
        "imports excluded; `cat` is its process's wall time. Reader CPU-s: the child and all "
        "its processes from the handshake's GO to the epoch's end, counted by the child "
        "(`getrusage` of itself and its reaped children plus `/proc/PID/stat` of those alive; "
        "`cat`: `wait4`). Bed CPU-s: `utime + stime` of the bed's "
        "daemons (`/proc/PID/stat`: master, chunkservers, mfsmount, all threads) over the "
        "same span.",
        "",
        "The ceiling (`bench_pfs.py _child ceiling`, benchmarks/pfs_ceiling.py): the shardio "
        "tar dataset's index and map mode's epoch order "
        '(`ShardDataset(DATA, mode="map", seed=S).epoch_order()`), cut in batches dealt to '
        f"{facts['workers']} forked processes as the DataLoader deals them, each `preadv` of "
        "every member of every sample of its batches into one reused buffer: no checksum, no "
        "hand-off to a training process, no per-sample Python beyond the loop. What no map-"
        "mode reader can beat on this access pattern.",
        "",
        "Targets (issue 37, part 2: on the pinned bed): each mode against `cat` (stream 0.90x, "
        "map 0.70x), or, the issue's other form, against the raw random-read ceiling (0.90x). "
        "Stream mode reads a window's members in a shuffled order too; it reads the window's "
        "shards whole and in sequence first, which the ceiling does not.",
        "",
        *verdicts(tallies),
        "",
        "### How it was run",
        "",
        f"`{facts['argv']}` (as root). Started {facts['started']}, "
        f"{facts['elapsed_s'] / 60:.1f} min. Load average before: {facts['load_before']}; at "
        f"the start of each round: {'; '.join(loads)}; after: {facts['load_after']}. "
        f"Epoch children: `{facts['child_cmd']}`, under `taskset -c {facts['reader_cpus']}` "
        "with `SHARDIO_PIN_WORKERS=0` (shardio would otherwise pin its workers next to a GPU, "
        "out of the reader CPUs).",
        "",
        f"Versions: {facts['versions']}.",
        "",
        facts["code_line"],
        "",
        f"Machine notes: {os.cpu_count()} CPUs. Affinity keeps the bed off the reader CPUs "
        "and the readers off the bed's, but other work on this machine (other helpers' "
        "tests during the run of record) is not pinned and takes CPU on both sides: compare "
        "ratios within a round.",
    ]
    return "\n".join(lines)
