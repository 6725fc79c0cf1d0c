"""The metadata budget, counted with strace: start-up opens the manifest and the index only,
whatever the shard count; steady-state reads cost one open per shard and no stat; from a
staging area, a copy costs its open, its stamp check (two lstat, the stamp's open and fstat)
and nothing per read.

The per-epoch budget of a loader's workers is in test_epoch_syscalls.py.
"""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest
from stracing import STRACE, run_traced

from shardio.packing.run import PackOptions, pack
from shardio.staging.stage import StageOptions, stage_dataset

NUM_SAMPLES = 2400
READS = 2000
OPEN_CALLS = {"open", "openat"}
STAT_CALLS = {"stat", "newfstatat", "statx", "lstat", "fstat"}
TRACED = ",".join(sorted(OPEN_CALLS | STAT_CALLS | {"write"}))

# "123 openat(AT_FDCWD</cwd>, "/x/y", O_RDONLY) = 3</x/y>" or, split by another thread,
# "123 openat(AT_FDCWD, "/x/y", O_RDONLY <unfinished ...>". Resumed halves hold no path.
SYSCALL = re.compile(r"^\d+\s+(?P<name>\w+)\((?P<args>.*)$")
QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
FD_PATH = re.compile(r"^\d+<([^>]*)>")
MARK = re.compile(r'write\(2(?:<[^>]*>)?, "SHARDIO-MARK ([^"\\]*)')


def tiny_tree(root):
    """NUM_SAMPLES files of 40-300 bytes in 4 class directories."""
    rng = np.random.default_rng(5)
    for i in range(NUM_SAMPLES):
        folder = root / f"class{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"s{i:05d}.bin").write_bytes(rng.bytes(int(rng.integers(40, 300))))


@pytest.fixture(scope="module")
def tiny_datasets(tmp_path_factory):
    """The tiny tree packed as tar with few and with many shards, and as hdf5."""
    src = tmp_path_factory.mktemp("tiny") / "src"
    tiny_tree(src)
    out = {}
    for name, fmt, size in [
        ("tar-few", "tar", 1536 * 1024),
        ("tar-many", "tar", 128 * 1024),
        ("hdf5", "hdf5", 96 * 1024),
        ("tar-lru", "tar", 48 * 1024),
    ]:
        dst = src.parent / name
        result = pack(
            str(src),
            str(dst),
            PackOptions(shard_format=fmt, shard_size_bytes=size, durable=False),
        )
        assert result.num_samples == NUM_SAMPLES
        out[name] = (os.path.realpath(dst), result.num_shards)
    area = src.parent / "tar-many-area"
    stage_dataset(out["tar-many"][0], area, StageOptions())
    out["tar-many-area"] = (os.path.realpath(area), out["tar-many"][1])
    return out


def paths_of(args):
    """The paths a traced call names: quoted strings and ``fd<path>`` annotations."""
    found = QUOTED.findall(args)
    fd = FD_PATH.match(args)
    if fd:
        found.append(fd.group(1))
    return found


def parse(log_text):
    """Split the log at the markers: {marker: [(call, [paths]), ...] until the next one}."""
    sections: dict[str, list[tuple[str, list[str]]]] = {"": []}
    current = ""
    for line in log_text.splitlines():
        mark = MARK.search(line)
        if mark:
            current = mark.group(1)
            sections[current] = []
            continue
        m = SYSCALL.match(line)
        if m and m.group("name") in OPEN_CALLS | STAT_CALLS:
            sections[current].append((m.group("name"), paths_of(m.group("args"))))
    return sections


def calls_inside(section, root, names):
    """Traced calls of ``names`` on a path inside ``root`` (the directory itself excluded)."""
    prefix = root.rstrip("/") + "/"
    return [
        (name, paths)
        for name, paths in section
        if name in names and any(p.startswith(prefix) for p in paths)
    ]


@pytest.fixture(scope="module")
def traced(tiny_datasets, tmp_path_factory):
    """One strace'd run: open each dataset; read 2,000 samples of each read dataset."""
    if shutil.which(STRACE) is None and not os.path.exists(STRACE):
        pytest.skip("strace is not installed (CI installs it): cannot count syscalls")
    work = tmp_path_factory.mktemp("strace")
    log = work / "strace.log"
    script = os.path.join(os.path.dirname(__file__), "scripts", "read_syscalls.py")
    specs = [
        tiny_datasets["tar-few"][0] + ":read",
        tiny_datasets["tar-many"][0] + ":read",
        tiny_datasets["hdf5"][0] + ":read",
        tiny_datasets["tar-lru"][0] + ":read",
        tiny_datasets["tar-many"][0] + ":read:" + tiny_datasets["tar-many-area"][0],
    ]
    text, touched = run_traced([script, str(READS), "7", *specs], log=log, traced=TRACED)
    return parse(text), touched, specs


def test_startup_opens_only_manifest_and_index_whatever_the_shard_count(traced, tiny_datasets):
    sections, _, _ = traced
    few_root, few_shards = tiny_datasets["tar-few"]
    many_root, many_shards = tiny_datasets["tar-many"]
    assert few_shards <= 5
    assert 35 <= many_shards < 64  # below FilePool's default max_open
    opened = {}
    stats = {}
    for n, root in enumerate([few_root, many_root, tiny_datasets["hdf5"][0]]):
        section = sections[f"open-start {n}"]
        opens = calls_inside(section, root, OPEN_CALLS)
        opened[n] = sorted(os.path.relpath(paths[0], root) for _, paths in opens)
        stats[n] = len(calls_inside(section, root, STAT_CALLS))
    assert opened[0] == opened[1] == opened[2] == ["index.bin", "manifest.json"]
    # fstat on the two open descriptors only; never a stat per shard.
    assert stats[0] == stats[1] == stats[2]
    assert stats[0] <= 8


@pytest.mark.parametrize(
    ("n", "name"), [(0, "tar-few"), (1, "tar-many"), (2, "hdf5"), (3, "tar-lru")]
)
def test_random_reads_open_each_shard_once_and_never_stat(traced, tiny_datasets, n, name):
    """Each shard is opened at most once, and nothing is stat'ed, by 2,000 random reads.

    The "tar-lru" dataset holds more shards than FilePool's default ``max_open`` (64):
    random map-style reads over it must still not reopen shards (each reopen is a metadata
    server round trip on Lustre).
    """
    sections, touched, _ = traced
    root, num_shards = tiny_datasets[name]
    if name == "tar-lru":
        assert num_shards > 64
    else:
        assert num_shards < 64
    section = sections[f"read-start {n}"]
    opens = calls_inside(section, root, OPEN_CALLS)
    opened = [paths[0] for _, paths in opens]
    assert len(opened) <= touched[str(n)] <= num_shards
    assert len(set(opened)) == len(opened), "a shard was opened twice"
    assert all(p.startswith(os.path.join(root, "shards") + "/") for p in opened)
    stats = calls_inside(section, root, STAT_CALLS)
    assert stats == [], stats[:5]


def test_random_reads_from_a_staging_area_check_each_copy_once(traced, tiny_datasets):
    """Each staged copy: one open, one stamp check (lstat of the copy and of its stamp, the
    stamp's open and fstat); no fstat per read, and nothing at the source."""
    sections, touched, _ = traced
    root, _ = tiny_datasets["tar-many"]
    area, _ = tiny_datasets["tar-many-area"]
    section = sections["read-start 4"]
    assert calls_inside(section, root, OPEN_CALLS | STAT_CALLS) == []
    opened = [os.path.relpath(p[0], area) for _, p in calls_inside(section, area, OPEN_CALLS)]
    copies = [p for p in opened if p.startswith("shards/")]
    stamps = [p for p in opened if p.startswith(".shardio-stage/ok/")]
    assert sorted(copies + stamps) == sorted(opened)
    assert len(set(copies)) == len(copies) == touched["4"]
    assert len(set(stamps)) == len(stamps) == touched["4"]
    stats = calls_inside(section, area, STAT_CALLS)
    assert len(stats) == 3 * touched["4"], stats[:5]
