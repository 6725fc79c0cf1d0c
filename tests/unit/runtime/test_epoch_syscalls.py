"""The per-epoch metadata budget of a ShardLoader with 2 workers, counted with strace.

Per epoch, for each shard the rank reads:

- from the source: one ``open`` in the training process, before the first epoch's workers
  start, and none after (forked workers read through the inherited descriptor, later epochs'
  workers too: one metadata-server request a node, not one a worker and epoch);
- from a staged copy: in each worker that reads it one ``open`` (``O_NOFOLLOW``) and one
  ``flock(LOCK_SH)`` before its first read, and in the training process, before the workers
  start, ``lstat`` of the copy and of its stamp (the stamp is opened and read only the first
  time, or once it changed);
- no stat of anything in a worker, no open of the manifest, the index or a stamp (a forked
  worker inherits them; the staging decisions were made once, in the training process).

A worker started by pickling (spawn, forkserver: Python 3.14's default) also maps the index,
a fixed number of calls whatever the shard count, and reads no manifest. And each worker
advises its first batches before it reads the first one, in both modes.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from typing import Any

import numpy as np
import pytest
from stracing import STRACE, run_traced

from shardio.packing.run import PackOptions, pack
from shardio.read.reader import ShardReader
from shardio.staging.stage import StageOptions, stage_dataset

NUM_SAMPLES = 1200
WORKERS = 2
EPOCHS = 2
BATCH = 16
DEPTH = 4  # ShardLoader's prefetch factor: the batches a worker advises before its first
OPEN_CALLS = {"open", "openat"}
STAT_CALLS = {"stat", "lstat", "fstat", "newfstatat", "statx"}
READ_CALLS = {"pread64", "preadv", "preadv2"}
TRACED = ",".join(
    sorted(OPEN_CALLS | STAT_CALLS | READ_CALLS | {"flock", "close", "fadvise64", "write"})
)

LINE = re.compile(r"^(?P<pid>\d+)\s+(?P<name>\w+)\((?P<args>.*)$")  # resumed halves: no match
FD_PATH = re.compile(r"^-?\d+<(?P<path>[^>]*)>")
QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
MARK = re.compile(r'"SHARDIO-MARK ([^"\\]*)')
ADVICE = re.compile(r"^\d+<[^>]*>, (?P<offset>\d+), (?P<length>\d+), POSIX_FADV_WILLNEED")


@dataclasses.dataclass(frozen=True)
class Call:
    """One traced call on a file of the dataset or of the staging area."""

    name: str
    where: str  # "src" or "area"
    rel: str  # path relative to the dataset or the area
    shard: bool  # a shard file (source or staged copy)
    args: str


@dataclasses.dataclass
class Run:
    """One traced run: calls by worker (id, epoch) and by training-process section."""

    workers: dict[tuple[int, int], list[Call]]
    main: dict[str, list[Call]]
    batches: list[list[list[str]]]  # keys of each delivered batch, per epoch


def _tree(root):
    """Samples of 20-60 KB: the members of different batches lie further apart than the
    reader merges into one advice, so each batch's advice shows in the trace."""
    rng = np.random.default_rng(12)
    for i in range(NUM_SAMPLES):
        folder = root / f"class{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"s{i:05d}.bin").write_bytes(rng.bytes(int(rng.integers(20_000, 60_000))))


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """The tree packed into about 40 and about 12 tar shards, each staged whole."""
    if not os.path.exists(STRACE):
        pytest.skip("strace is not installed (CI installs it): cannot count syscalls")
    base = tmp_path_factory.mktemp("epochs")
    _tree(base / "src")
    out = {}
    for name, size in [("many", 1200 * 1024), ("few", 4 * 1024 * 1024)]:
        root = base / name
        result = pack(
            str(base / "src"),
            str(root),
            PackOptions(shard_format="tar", shard_size_bytes=size, durable=False),
        )
        area = base / f"{name}-area"
        stage_dataset(root, area, StageOptions())
        out[name] = (os.path.realpath(root), os.path.realpath(area), result.num_shards)
    assert out["many"][2] >= 30
    assert out["few"][2] <= out["many"][2] // 2
    return out


def _parse(text: str, root: str, area: str, shards: set[str], batches: Any) -> Run:
    lines = [m for m in map(LINE.match, text.splitlines()) if m]
    main_pid = lines[0].group("pid")
    role: dict[str, tuple[int, int]] = {}
    for m in lines:
        mark = MARK.search(m.group("args")) if m.group("name") == "write" else None
        if mark and mark.group(1).startswith("worker "):
            _, w, _, e = mark.group(1).split()
            role[m.group("pid")] = (int(w), int(e))
    workers: dict[tuple[int, int], list[Call]] = collections.defaultdict(list)
    main: dict[str, list[Call]] = collections.defaultdict(list)
    section = "startup"
    for m in lines:
        pid, name, args = m.group("pid"), m.group("name"), m.group("args")
        if name == "write":
            mark = MARK.search(args)
            if mark and pid == main_pid:
                what, epoch = mark.group(1).split()[:2]
                section = f"e{epoch}" if what == "epoch-start" else f"after-e{epoch}"
            continue
        fd = FD_PATH.match(args)
        quoted = QUOTED.search(args)
        path = fd.group("path") if fd else quoted.group(1) if quoted else ""
        for where, prefix in (("area", area), ("src", root)):
            if path.startswith(prefix + "/"):
                rel = path[len(prefix) + 1 :]
                call = Call(name, where, rel, rel in shards, args)
                if pid == main_pid:
                    main[section].append(call)
                elif pid in role:
                    workers[role[pid]].append(call)
                break
    return Run(dict(workers), dict(main), batches)


_RUNS: dict[tuple[str, str, bool, str | None, int], Run] = {}


@pytest.fixture(scope="module")
def traced(datasets, tmp_path_factory):
    """``traced(dataset, mode, cached, context=None, epochs=EPOCHS)``: one strace'd run of
    scripts/epoch_syscalls.py (2 workers), parsed; each run made once per module."""
    work = tmp_path_factory.mktemp("strace")
    script = os.path.join(os.path.dirname(__file__), "scripts", "epoch_syscalls.py")

    def run(name: str, mode: str, cached: bool, context: str | None = None, epochs=EPOCHS):
        key = (name, mode, cached, context, epochs)
        if key not in _RUNS:
            root, area, _ = datasets[name]
            log = work / f"{name}-{mode}-{cached}-{context}-{epochs}.log"
            args = [root, mode, area if cached else "-", str(epochs), str(WORKERS), str(BATCH)]
            text, batches = run_traced(
                [script, *args, *([context] if context else [])],
                log=log,
                traced=TRACED,
                timeout=180,
            )
            with ShardReader(root) as ds:
                shards = {s.path for s in ds.manifest.shards}
            _RUNS[key] = _parse(text, root, area, shards, batches)
        return _RUNS[key]

    return run


def _check_worker_budget(run: Run, cached: bool) -> None:
    assert len(run.workers) == WORKERS * len({e for _, e in run.workers})
    for who, calls in run.workers.items():
        read = {c.rel for c in calls if c.name in READ_CALLS and c.shard}
        assert read, f"worker {who} read nothing"
        opens = [c for c in calls if c.name in OPEN_CALLS]
        assert [c.rel for c in opens if not c.shard] == [], f"worker {who}: manifest/index/stamp"
        opened = [c.rel for c in opens]
        assert len(opened) == len(set(opened)), f"worker {who} opened a shard twice"
        if cached:
            assert set(opened) == read
        else:
            assert opened == [], f"worker {who} opened a source shard the loader had opened"
            by_loader = {c.rel for c in run.main.get("e0", []) if c.name in OPEN_CALLS}
            assert read <= by_loader, f"worker {who} read a shard nobody opened"
        stats = [(c.name, c.rel) for c in calls if c.name in STAT_CALLS]
        assert stats == [], f"worker {who} stat'ed {stats[:5]}"
        flocks = [c for c in calls if c.name == "flock"]
        if cached:
            assert {c.where for c in opens} == {"area"}, "a staged shard was read from the source"
            assert all("O_NOFOLLOW" in c.args for c in opens)
            assert sorted(c.rel for c in flocks) == sorted(opened), "one LOCK_SH per copy"
            assert all("LOCK_SH" in c.args for c in flocks)
            locked: set[str] = set()
            for c in calls:
                if c.name == "flock":
                    locked.add(c.rel)
                elif c.name in READ_CALLS | {"fadvise64"}:
                    assert c.rel in locked, f"worker {who} used {c.rel} before locking it"
        else:
            assert flocks == []


@pytest.mark.parametrize("cached", [False, True], ids=["source", "staged"])
@pytest.mark.parametrize("mode", ["map", "stream"])
def test_a_worker_opens_each_shard_once_and_stats_nothing(traced, mode, cached):
    _check_worker_budget(traced("many", mode, cached), cached)


@pytest.mark.parametrize("cached", [False, True], ids=["source", "staged"])
@pytest.mark.parametrize("mode", ["map", "stream"])
def test_the_training_process_opens_each_source_shard_once_and_checks_staged_ones_once(
    traced, datasets, mode, cached
):
    run = traced("many", mode, cached)
    n = datasets["many"][2]
    for epoch in range(EPOCHS):
        calls = run.main.get(f"e{epoch}", [])
        if not cached:
            # Each source shard opened once, before the first epoch's workers; kept open.
            opened = [c.rel for c in calls if c.name in OPEN_CALLS]
            assert all(c.shard and c.where == "src" for c in calls), calls[:5]
            assert [c for c in calls if c.name in STAT_CALLS] == [], calls[:5]
            assert sorted(opened) == (sorted(set(opened)) if epoch == 0 else [])
            assert len(opened) == (n if epoch == 0 else 0)
            continue
        assert all(c.where == "area" for c in calls)
        assert [c for c in calls if c.shard and c.name not in STAT_CALLS] == [], "a copy opened"
        by_kind = collections.Counter(
            ("stat" if c.name in STAT_CALLS else c.name, c.shard) for c in calls
        )
        # Every shard of the epoch, before the first epoch's workers start: lstat of the copy
        # and of its stamp, the stamp's open, fstat and close. Later epochs: nothing, the
        # persistent workers (the default) keep what they decided and hold the copies open.
        if epoch == 0:
            expected = {("stat", True): n, ("stat", False): 2 * n}
            expected |= {("openat", False): n, ("close", False): n}
        else:
            expected = {}
        assert dict(by_kind) == expected


def test_a_worker_started_by_pickling_reads_no_manifest_and_a_fixed_startup(traced):
    """forkserver (torch preloaded: quicker than spawn) pickles the dataset as spawn does."""
    startup = {}
    for name in ("many", "few"):
        run = traced(name, "map", True, "forkserver", 1)
        _check_worker_budget_pickled(run)
        for who, calls in run.workers.items():
            others = collections.Counter((c.name, c.rel) for c in calls if not c.shard)
            assert not any(rel == "manifest.json" for _, rel in others), others
            assert not any(".shardio-stage" in rel for _, rel in others), "a stamp in a worker"
            startup[name, who] = others
    assert {k[1] for k in startup} == {(w, 0) for w in range(WORKERS)}
    for w in range(WORKERS):
        assert startup["many", (w, 0)] == startup["few", (w, 0)]
        assert sum(startup["many", (w, 0)].values()) <= 8  # the index: open, fstat, close


def _check_worker_budget_pickled(run: Run) -> None:
    """The shard budget of a worker, leaving out its index (mapped at its start)."""
    shard_only = Run(
        {who: [c for c in calls if c.shard] for who, calls in run.workers.items()},
        run.main,
        run.batches,
    )
    _check_worker_budget(shard_only, cached=True)


def test_each_worker_advises_its_first_batches_before_reading_any(traced, datasets):
    """Map mode. Stream mode reads its shards ahead instead (a thread of the worker's, with
    ``sendfile``: tests/unit/runtime/test_read_strategy.py)."""
    run = traced("many", "map", False)
    root = datasets["many"][0]
    with ShardReader(root) as ds:
        sample_of = {ds.key(i): i for i in range(len(ds))}
        idx = ds.index

        def ranges(keys):
            for key in keys:
                sample = sample_of[key]
                shard = ds.manifest.shards[ds.shard_of(sample)].path
                for m in idx.sample_member_range(sample):
                    rec = idx.members[m]
                    yield shard, int(rec["offset"]), int(rec["offset"]) + int(rec["size"])

        for (worker, epoch), calls in run.workers.items():
            first_read = next(i for i, c in enumerate(calls) if c.name in READ_CALLS)
            advised = collections.defaultdict(list)
            for c in calls[:first_read]:
                if c.name == "fadvise64":
                    m = ADVICE.match(c.args)
                    assert m is not None, c.args
                    lo = int(m.group("offset"))
                    advised[c.rel].append((lo, lo + int(m.group("length"))))
            mine = run.batches[epoch][worker::WORKERS][:DEPTH]
            assert len(mine) == DEPTH
            for batch in mine:
                for shard, lo, hi in ranges(batch):
                    assert any(a <= lo and hi <= b for a, b in advised[shard]), (
                        f"worker {worker}, epoch {epoch}: {shard} [{lo}, {hi}) was not advised "
                        "before the worker's first read"
                    )
