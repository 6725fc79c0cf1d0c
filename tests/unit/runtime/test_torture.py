"""The fault-proof read path under real damage, in a real 2-rank gloo job.

601 small samples in about 70 tar shards, about 70% of them staged; then 50+ seeded faults
in the real files: bytes flipped inside members, staged copies truncated or deleted, silent
corruption (a flip or a cut with its stamp refreshed, as bit rot leaves it), and some source
shards flipped or truncated, chosen so that training has to read them. Each rank reads one
epoch with 2 workers through ``ShardDataset(recovery="skip")`` (scripts/torture_rank.py).
No wrong byte may arrive, ranks keep equal counts, each sample arrives once or is listed as
substituted, each damaged staged copy with a good source is repaired, and each damaged
source shard is journaled. Then a job is SIGKILLed in the middle of a re-stage and resumed
from its checkpoints: it delivers exactly what the uninterrupted run delivered.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import random
import time
from typing import Any

import pytest
import xxhash
from torturing import (
    BATCH,
    FAULT_SEED,
    JOB_TIMEOUT_S,
    NUM_FILES,
    ORDER_SEED,
    PER_RANK,
    SHARD_SIZE_BYTES,
    WORLD,
    finish_job,
    flip,
    kill_job,
    logs,
    payload_members,
    read_run,
    start_job,
    steps_of,
    write_tree,
)

from shardio import RecoveryPolicy
from shardio.format.checksum import file_xxh3_128
from shardio.metrics.progress import Counters
from shardio.packing.run import PackOptions, pack
from shardio.read.journal import read_journal
from shardio.read.reader import ShardReader
from shardio.runtime.dataset import ShardDataset
from shardio.staging import StageOptions, stage_dataset
from shardio.staging.copy import leftover_temps, stage_one, temps_of
from shardio.staging.protocol import stamp_matches, stamp_path, write_stamp
from shardio.storage.atomic import is_temp_name

STAGED_FRACTION = 0.7
STAGE_OPTIONS = StageOptions(durable=False)
JOURNAL = pathlib.Path(".shardio-stage") / "repairs.jsonl"
# What a damaged staged copy becomes: written in place (its stamp no longer matches),
# silently corrupted (its stamp refreshed: only the member checksums can tell), or removed.
STAGED_KINDS = ("flip", "flip", "rot", "truncate", "truncate-rot", "delete")


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault put into a real file."""

    where: str  # "staged" or "source"
    kind: str
    rel: str
    at: int  # the byte flipped, or the length truncated to (-1: deleted)


@dataclasses.dataclass
class Torture:
    """The damaged dataset and what the faulty run delivered."""

    src: pathlib.Path
    stage: pathlib.Path
    payload: dict[str, bytes]
    label: dict[str, int]
    keys: list[str]  # dataset order
    rels: list[str]
    xxh3: dict[str, str]  # rel -> the manifest's xxh3-128
    staged: set[str]
    faults: list[Fault]
    bad_keys: set[str]  # samples no good copy of which exists anywhere
    runs: list[dict[str, Any]]  # per rank: keys, digests, labels, done
    events: list[dict[str, Any]]

    def faults_in(self, where: str) -> set[str]:
        return {f.rel for f in self.faults if f.where == where}

    @property
    def repairable(self) -> set[str]:
        """Damaged staged copies whose source is intact."""
        return self.faults_in("staged") - self.faults_in("source")


# ------------------------------------------------------------------------------ the data


def plan_and_apply(
    src: pathlib.Path,
    stage: pathlib.Path,
    staged: list[str],
    unstaged: list[str],
    members: dict[str, list[tuple[str, int, int]]],
    xxh3: dict[str, str],
) -> tuple[list[Fault], set[str]]:
    """Damage the files; return the faults and the keys left with no good copy."""
    rng = random.Random(FAULT_SEED)
    faults: list[Fault] = []
    bad: set[str] = set()

    def cut_point(rel: str) -> int:
        _key, offset, size = rng.choice(members[rel][1:])  # never the first: keep a prefix
        return offset + rng.randrange(size)

    damaged = rng.sample(staged, round(len(staged) * 0.8))
    for n, rel in enumerate(damaged):
        kind = STAGED_KINDS[n % len(STAGED_KINDS)]
        path = stage / rel
        if kind in ("flip", "rot"):
            chosen = rng.sample(members[rel], 1 if kind == "rot" else rng.randint(1, 3))
            for _key, offset, size in chosen:
                at = offset + rng.randrange(size)
                flip(path, at)
                faults.append(Fault("staged", kind, rel, at))
        elif kind in ("truncate", "truncate-rot"):
            at = cut_point(rel)
            os.truncate(path, at)
            faults.append(Fault("staged", kind, rel, at))
        else:
            path.unlink()
            faults.append(Fault("staged", kind, rel, -1))
        if kind.endswith("rot"):
            write_stamp(os.fspath(stage), rel, xxh3[rel], False)  # stat shows nothing now
    # Source damage where training has to read it: shards not staged, and shards whose
    # staged copy was written or removed (rot would still serve some samples from the copy).
    both = [f.rel for f in faults if f.kind in ("flip", "delete")]
    targets = rng.sample(unstaged, 5) + rng.sample(sorted(set(both)), 2)
    for n, rel in enumerate(targets):
        if n % 2 == 0:
            _key, offset, size = rng.choice(members[rel])
            at = offset + rng.randrange(size)
            flip(src / rel, at)
            bad |= {k for k, o, s in members[rel] if o <= at < o + s}
            faults.append(Fault("source", "flip", rel, at))
        else:
            at = cut_point(rel)
            os.truncate(src / rel, at)
            bad |= {k for k, o, s in members[rel] if o + s > at}
            faults.append(Fault("source", "truncate", rel, at))
    return faults, bad


# ------------------------------------------------------------------------------ the jobs


def temp_files(root: pathlib.Path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, n), root)
        for d, _, names in os.walk(root)
        for n in names
        if is_temp_name(n)
    )


@pytest.fixture(scope="module")
def torture(tmp_path_factory, scripts_dir, child_env) -> Torture:
    """Pack, stage 70%, damage 50+ places, run the 2-rank job once."""
    base = tmp_path_factory.mktemp("torture")
    payload, label = write_tree(base / "tree")
    src, stage = base / "src", base / "stage"
    pack(
        os.fspath(base / "tree"),
        os.fspath(src),
        PackOptions(shard_size_bytes=SHARD_SIZE_BYTES, durable=False),
    )
    keys, members = payload_members(src)
    with ShardReader(src) as ds:
        entries = list(ds.manifest.shards)
    assert 60 <= len(entries) <= 100, len(entries)
    xxh3 = {e.path: e.xxh3_128 for e in entries}
    capacity = int(sum(e.size_bytes for e in entries) * STAGED_FRACTION)
    stage_dataset(src, stage, dataclasses.replace(STAGE_OPTIONS, capacity_bytes=capacity))
    staged = [e.path for e in entries if stamp_matches(os.fspath(stage), e.path, e.xxh3_128)]
    unstaged = [e.path for e in entries if e.path not in staged]
    assert 0.6 * len(entries) <= len(staged) <= 0.75 * len(entries), len(staged)
    faults, bad = plan_and_apply(src, stage, staged, unstaged, members, xxh3)

    out = base / "run"
    finish_job(start_job(scripts_dir / "torture_rank.py", src, stage, out, child_env()), out)
    return Torture(
        src=src,
        stage=stage,
        payload=payload,
        label=label,
        keys=keys,
        rels=[e.path for e in entries],
        xxh3=xxh3,
        staged=set(staged),
        faults=faults,
        bad_keys=bad,
        runs=[read_run(out, r) for r in range(WORLD)],
        events=read_journal(stage / JOURNAL),
    )


def expected_keys(t: Torture) -> list[list[str]]:
    """Each rank's keys of an epoch without faults: its positions of the padded order."""
    order = [t.keys[i] for i in ShardDataset(t.src, seed=ORDER_SEED).epoch_order()]
    padded = order + order[: PER_RANK * WORLD - len(order)]
    return [padded[r::WORLD] for r in range(WORLD)]


def staged_copy_verifies(t: Torture, rel: str) -> bool:
    path = t.stage / rel
    return (
        path.is_file()
        and file_xxh3_128(path) == t.xxh3[rel]
        and stamp_matches(os.fspath(t.stage), rel, t.xxh3[rel])
    )


# ------------------------------------------------------------------------------ the checks


def test_the_damage_is_real_and_plenty(torture: Torture) -> None:
    assert len(torture.faults) >= 50
    staged_faults = [f for f in torture.faults if f.where == "staged"]
    assert {f.kind for f in staged_faults} == set(STAGED_KINDS)
    assert len(torture.faults_in("source")) == 7
    assert torture.faults_in("source") & torture.faults_in("staged"), "no doubly damaged shard"
    assert len(torture.bad_keys) >= 7


def test_every_delivered_byte_is_right_and_ranks_stay_equal(torture: Torture) -> None:
    for r, run in enumerate(torture.runs):
        done = run["done"]
        assert done["samples_per_rank"] == PER_RANK
        assert done["delivered"] == done["min"] == done["max"] == PER_RANK, (r, done)
        assert done["steps"] == done["len_loader"] == -(-PER_RANK // BATCH)
        assert len(run["keys"]) == len(run["digests"]) == PER_RANK
        wrong = [
            key
            for key, digest, cls in zip(run["keys"], run["digests"], run["labels"], strict=True)
            if digest != xxhash.xxh3_128_hexdigest(torture.payload[key])
            or cls != torture.label[key]
        ]
        assert wrong == [], f"rank {r} got wrong bytes for {len(wrong)} sample(s): {wrong[:3]}"


def test_every_sample_arrives_once_or_is_listed_as_substituted(torture: Torture) -> None:
    events = torture.events
    assert not [e for e in events if e["event"] == "raise"]
    skips = [e for e in events if e["event"] == "skip"]
    assert {e["key"] for e in skips} == torture.bad_keys
    expected = expected_keys(torture)
    for r, run in enumerate(torture.runs):
        substitutes = collections.defaultdict(set)
        for e in skips:
            if e["rank"] == r:
                substitutes[e["key"]].add(e["substitute_key"])
        share = set(expected[r])
        for i, (want, got) in enumerate(zip(expected[r], run["keys"], strict=True)):
            if want in torture.bad_keys:
                assert got in substitutes[want], f"rank {r} position {i}: {want} -> {got}"
                assert got in share and got not in torture.bad_keys
            else:
                assert got == want, f"rank {r} position {i}: expected {want}, got {got}"
    # Over the job: each good sample once (the padding twice), each bad one never.
    delivered = collections.Counter(k for run in torture.runs for k in run["keys"])
    wanted = collections.Counter(k for keys in expected for k in keys)
    assert not set(delivered) & torture.bad_keys
    substituted = sum(n for k, n in wanted.items() if k in torture.bad_keys)
    extra = delivered - collections.Counter(
        {k: n for k, n in wanted.items() if k not in torture.bad_keys}
    )
    assert sum(extra.values()) == substituted
    assert set(wanted) == set(torture.keys)
    padding = PER_RANK * WORLD - NUM_FILES
    assert sum(wanted.values()) - len(torture.keys) == padding


def test_damaged_staged_copies_with_a_good_source_are_repaired(torture: Torture) -> None:
    by_shard = collections.defaultdict(list)
    for e in torture.events:
        by_shard[e.get("shard")].append(e)
    repairable = torture.repairable
    assert len(repairable) >= 25
    for rel in sorted(repairable):
        kinds = {e["event"] for e in by_shard[rel]}
        assert kinds & {"drop", "restage"}, f"damaged copy {rel} was never detected: {kinds}"
        assert "restage_failed" not in kinds, by_shard[rel]
        assert staged_copy_verifies(torture, rel), f"staged copy {rel} was not repaired"
    for rel in sorted(torture.staged - torture.faults_in("staged")):
        assert by_shard[rel] == [], f"intact copy {rel} has events: {by_shard[rel]}"
        assert staged_copy_verifies(torture, rel)
    untouched = set(torture.rels) - torture.staged - torture.faults_in("source")
    assert not [e for rel in untouched for e in by_shard[rel]]


def test_damaged_source_shards_are_journaled(torture: Torture) -> None:
    bad_sources = torture.faults_in("source")
    for rel in sorted(bad_sources):
        kinds = {e["event"] for e in torture.events if e.get("shard") == rel}
        assert "skip" in kinds, f"damaged source {rel}: events {kinds}"
        if rel in torture.staged:
            assert "restage_failed" in kinds, f"{rel}: re-staging a bad source must fail"
    skipped_in = {e["shard"] for e in torture.events if e["event"] == "skip"}
    assert skipped_in == bad_sources


def test_sigkill_in_a_restage_then_resume_delivers_the_uninterrupted_epoch(
    torture: Torture, scripts_dir: pathlib.Path, child_env: Any, tmp_path: pathlib.Path
) -> None:
    """Both ranks are killed while a worker re-stages a copy damaged mid-run; they resume
    from the last step both checkpointed, with the dead copy's temp file still there."""
    script = scripts_dir / "torture_rank.py"
    stall = tmp_path / "stall"
    stall.mkdir()
    first = tmp_path / "first"
    env = child_env({"TORTURE_STALL_COPY": os.fspath(stall)})
    journal_before = len(torture.events)
    # Copies that training reads late in the epoch (after the kill): damaged mid-run.
    order = [k for keys in zip(*expected_keys(torture), strict=True) for k in keys]
    late = {k for k in order[int(len(order) * 0.8) :]}
    with ShardReader(torture.src) as ds:
        late_rels = {ds.manifest.shards[ds.shard_of(torture.keys.index(k))].path for k in late}
    victims = sorted(
        rel
        for rel in late_rels & torture.staged
        if rel not in torture.faults_in("source") and staged_copy_verifies(torture, rel)
    )[:6]
    assert len(victims) >= 3

    procs = start_job(script, torture.src, torture.stage, first, env, "--sleep-s", "0.1")
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while min(len(steps_of(first, r)) for r in range(WORLD)) < 3:
            assert all(p.poll() is None for p in procs), f"a rank ended early:\n{logs(first)}"
            assert time.monotonic() < deadline, f"no checkpoints:\n{logs(first)}"
            time.sleep(0.01)
        (stall / "tmp").write_text(json.dumps(victims))
        (stall / "tmp").rename(stall / "armed")  # whole, or not yet there
        for rel in victims:  # in place, to about one sample: open descriptors see it too
            os.truncate(torture.stage / rel, (torture.stage / rel).stat().st_size // 8)
        while not (stall / "stalled").exists():
            assert all(p.poll() is None for p in procs), f"a rank ended early:\n{logs(first)}"
            assert time.monotonic() < deadline, f"no re-stage began:\n{logs(first)}"
            time.sleep(0.005)
        assert temp_files(torture.stage), "the re-stage has no temp file to leave behind"
    finally:
        kill_job(procs)
    assert all(p.returncode == -9 for p in procs)
    leftovers = temp_files(torture.stage)
    assert leftovers

    # Resume both ranks from the last step both checkpointed (they run in lockstep).
    steps = [steps_of(first, r) for r in range(WORLD)]
    common = min(len(s) for s in steps) - 1
    assert 2 <= common < -(-PER_RANK // BATCH) - 1
    second = tmp_path / "second"
    resume = [first / f"rank-{r}" / f"step-{common:06d}.json" for r in range(WORLD)]
    finish_job(
        start_job(script, torture.src, torture.stage, second, child_env(), resume=resume), second
    )
    for r in range(WORLD):
        head = [s for s in steps[r] if s["step"] <= common]
        rest = read_run(second, r)
        assert rest["steps"][0]["step"] == common + 1
        keys = [k for s in head for k in s["keys"]] + rest["keys"]
        digests = [d for s in head for d in s["digests"]] + rest["digests"]
        assert keys == torture.runs[r]["keys"], f"rank {r} resumed to other samples"
        assert digests == torture.runs[r]["digests"]
        assert rest["done"]["min"] == rest["done"]["max"]

    # A copy killed mid-copy had been dropped first (no copy, no stamp: read from the
    # source, like a shard never staged); every other victim was staged again on read.
    temps = leftover_temps(os.fspath(torture.stage), {os.path.dirname(r) for r in leftovers})
    killed = set(temps)
    assert killed and killed <= set(victims), (killed, victims)
    events = read_journal(torture.stage / JOURNAL)[journal_before:]
    for rel in victims:
        if rel in killed:
            assert not (torture.stage / rel).exists()
            assert not os.path.exists(stamp_path(os.fspath(torture.stage), rel))
            continue
        assert any(e.get("shard") == rel and e["event"] == "restage" for e in events), rel
        assert staged_copy_verifies(torture, rel)
    assert not [
        e
        for e in events
        if e["event"] in ("raise", "restage_failed")
        and e["shard"] not in torture.faults_in("source")
    ]
    # Staging those shards again (as the next ``shardio stage`` does) removes what the
    # killed copies left.
    assert set(temp_files(torture.stage)) == set(leftovers)
    with ShardReader(torture.src) as ds:
        for entry in ds.manifest.shards:
            if entry.path in killed:
                stage_one(
                    os.fspath(torture.src),
                    os.fspath(torture.stage),
                    entry,
                    temps_of(entry, temps),
                    durable=False,
                    counters=Counters(shared=False),
                )
                assert staged_copy_verifies(torture, entry.path)
    assert temp_files(torture.stage) == []


def test_a_resume_substitutes_as_the_uninterrupted_run_did(tmp_path: pathlib.Path) -> None:
    """Sample b fails and its first substitute c lies in a shard where sample a failed
    earlier: c itself is good, so both the uninterrupted run (which saw a fail) and a run
    resumed between a and b (which did not) must take c."""
    write_tree(tmp_path / "tree", files=200)
    src = tmp_path / "src"
    pack(
        os.fspath(tmp_path / "tree"),
        os.fspath(src),
        PackOptions(shard_size_bytes=SHARD_SIZE_BYTES, durable=False),
    )
    _keys, members = payload_members(src)

    def make() -> Any:
        return ShardDataset(
            src,
            seed=ORDER_SEED,
            recovery=RecoveryPolicy(
                policy="skip", retries=0, journal=os.fspath(tmp_path / "repairs.jsonl")
            ),
        )

    probe = make()
    order = probe.epoch_order().tolist()
    position = {s: p for p, s in enumerate(order)}
    shard_of = probe.packed.shard_of
    found = None
    assert probe.recovering is not None
    candidates = probe.recovering.for_process(probe).candidates
    for b in order[len(order) // 2 :]:
        c = next(iter(candidates(b)))
        earlier = [
            a
            for a in order[: position[b] - 2 * BATCH]
            if shard_of(a) == shard_of(c) != shard_of(b) and a != c
        ]
        if earlier:
            found = (earlier[0], b, c)
            break
    assert found is not None
    a, b, c = found
    rels = [s.path for s in probe.packed.manifest.shards]
    for sample in (a, b):
        key = probe.packed.key(sample)
        _key, offset, size = next(m for m in members[rels[shard_of(sample)]] if m[0] == key)
        flip(src / rels[shard_of(sample)], offset + size // 2)

    full = [k for batch in make().loader(BATCH, 0) for k in batch["__key__"]]
    assert full[position[b]] == probe.packed.key(c)
    loader = make().loader(BATCH, 0)
    head: list[str] = []
    for batch in loader:
        head += batch["__key__"]
        if len(head) > position[a]:
            state = loader.state_dict()
            break
    resumed = make().loader(BATCH, 0)
    resumed.load_state_dict(state)
    assert head + [k for batch in resumed for k in batch["__key__"]] == full
