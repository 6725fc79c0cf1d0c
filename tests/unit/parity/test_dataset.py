"""shardio.parity.dataset on real packed datasets: the encode journal (resume keeps intact
groups, a torn line is ignored, a file no run journaled is refused), the cell table loaded
or refused, and rebuild_files under the group lock (two processes at once rebuild once; a
lock held too long is a bounded, typed error)."""

from __future__ import annotations

import errno
import fcntl
import json
import multiprocessing
import os
import pathlib
import random
import time

import pytest

pytest.importorskip("pyeclib")

from shardio.errors import IntegrityError, StorageError, UsageError
from shardio.format.manifest import load_manifest
from shardio.format.spec import WORK_DIR
from shardio.packing.run import PackOptions, pack
from shardio.parity.dataset import LOCK_DIR, load_table, rebuild_files
from shardio.parity.encode import JOURNAL, encode_parity, finish_journal


def _tree(root: pathlib.Path, files: int = 24) -> None:
    rng = random.Random(3)
    for i in range(files):
        path = root / f"c{i % 2}" / f"{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(rng.randrange(3000, 9000)))


@pytest.fixture
def plain(tmp_path: pathlib.Path) -> pathlib.Path:
    """A dataset of about 10 shards, packed without parity."""
    _tree(tmp_path / "tree")
    dst = tmp_path / "ds"
    pack(str(tmp_path / "tree"), str(dst), PackOptions(shard_size_bytes=16 << 10, durable=False))
    assert len(load_manifest(dst / "manifest.json").shards) >= 8
    return dst


@pytest.fixture
def with_parity(tmp_path: pathlib.Path) -> pathlib.Path:
    _tree(tmp_path / "tree2")
    dst = tmp_path / "pds"
    pack(str(tmp_path / "tree2"), str(dst),
         PackOptions(shard_size_bytes=16 << 10, durable=False, parity="3+2"))  # fmt: skip
    return dst


def _encode(root: pathlib.Path, k: int = 3, m: int = 1) -> object:
    man = load_manifest(root / "manifest.json")
    return encode_parity(str(root), man.shards, k=k, m=m, durable=False)


def _parity_files(root: pathlib.Path) -> dict[str, tuple[bytes, tuple[int, int]]]:
    return {
        p.name: (p.read_bytes(), (p.stat().st_ino, p.stat().st_mtime_ns))
        for p in (root / "parity").glob("group-*")
    }


def test_a_killed_encode_keeps_the_groups_its_journal_lists(plain: pathlib.Path) -> None:
    first = _encode(plain)
    done = _parity_files(plain)
    journal = plain / JOURNAL
    lines = journal.read_bytes().splitlines(keepends=True)
    assert json.loads(lines[0])["plan"]["k"] == 3 and len(lines) == 1 + len(first.groups)
    # As a kill leaves it: the plan, two finished groups, a torn line; later files gone.
    journal.write_bytes(b"".join(lines[:3]) + lines[3][:10])
    kept = {json.loads(line)["group"] for line in lines[1:3]}
    for name in list(done):
        if int(name[6:12]) not in kept:
            (plain / "parity" / name).unlink()
    (plain / "parity" / ".group-000001.p0.shardio-tmp-123").write_bytes(b"half")
    again = _encode(plain)
    assert again == first
    now = _parity_files(plain)
    assert {n: b for n, (b, _) in now.items()} == {n: b for n, (b, _) in done.items()}
    for name, (_data, inode) in now.items():
        assert (inode == done[name][1]) == (int(name[6:12]) in kept), name  # kept, not rewritten
    assert not [p for p in (plain / "parity").iterdir() if "shardio-tmp" in p.name]
    finish_journal(str(plain))
    assert not (plain / WORK_DIR).exists()


def test_a_journaled_group_whose_file_changed_is_encoded_again(plain: pathlib.Path) -> None:
    first = _encode(plain)
    victim = plain / "parity" / "group-000001.p0"
    raw = bytearray(victim.read_bytes())
    raw[0] ^= 1
    victim.write_bytes(raw)
    assert _encode(plain) == first
    assert victim.read_bytes() != bytes(raw)


def test_a_file_no_run_journaled_is_refused_and_left_alone(plain: pathlib.Path) -> None:
    (plain / "parity").mkdir()
    stranger = plain / "parity" / "group-000002.cells"
    stranger.write_bytes(b"someone's")
    with pytest.raises(UsageError, match="no parity run of shardio recorded writing it"):
        _encode(plain)
    assert stranger.read_bytes() == b"someone's"
    assert sorted(p.name for p in (plain / "parity").iterdir()) == ["group-000002.cells"]


def test_a_damaged_data_shard_stops_the_encode_of_its_group(plain: pathlib.Path) -> None:
    man = load_manifest(plain / "manifest.json")
    shard = plain / man.shards[4].path
    raw = bytearray(shard.read_bytes())
    raw[700] ^= 4
    shard.write_bytes(raw)
    with pytest.raises(IntegrityError, match="parity is only computed over verified shards"):
        _encode(plain)
    assert not (plain / "parity" / "group-000001.p0").exists()  # shard 4 is in group 1


def test_the_cell_table_is_checked_against_the_manifest(with_parity: pathlib.Path) -> None:
    man = load_manifest(with_parity / "manifest.json")
    table = load_table(str(with_parity), man, 0)
    assert table is not None and table.num_data == 3 and table.m == 2
    cells = with_parity / man.parity.groups[0].cells.path
    raw = bytearray(cells.read_bytes())
    raw[-1] ^= 1
    cells.write_bytes(raw)
    assert load_table(str(with_parity), man, 0) is None  # damaged: the rebuild goes by files
    cells.write_bytes(bytes(raw[:-8]))
    assert load_table(str(with_parity), man, 0) is None
    cells.unlink()
    assert load_table(str(with_parity), man, 0) is None


def test_a_damaged_cell_table_alone_is_written_again(with_parity: pathlib.Path) -> None:
    man = load_manifest(with_parity / "manifest.json")
    cells = with_parity / man.parity.groups[1].cells.path
    good = cells.read_bytes()
    cells.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    done = rebuild_files(str(with_parity), man, 1, [man.parity.groups[1].cells.path],
                         durable=False)  # fmt: skip
    assert done.rebuilt == (man.parity.groups[1].cells.path,)
    assert cells.read_bytes() == good


def _rebuild_in_child(root: str, shard: int, out: str) -> None:
    man = load_manifest(os.path.join(root, "manifest.json"))
    done = rebuild_files(root, man, shard // 3, [man.shards[shard].path], durable=False)
    pathlib.Path(out).write_text(json.dumps(list(done.rebuilt)))


def test_two_processes_rebuilding_one_shard_rebuild_it_once(
    with_parity: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    man = load_manifest(with_parity / "manifest.json")
    shard = with_parity / man.shards[4].path
    good = shard.read_bytes()
    shard.unlink()
    ctx = multiprocessing.get_context("fork")
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    procs = [ctx.Process(target=_rebuild_in_child, args=(str(with_parity), 4, str(o)))
             for o in outs]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    results = sorted(json.loads(o.read_text()) for o in outs)
    assert results == [[], [man.shards[4].path]]  # one rebuilt it; the other found it rebuilt
    assert shard.read_bytes() == good


def test_a_lock_held_too_long_is_a_bounded_typed_error(with_parity: pathlib.Path) -> None:
    man = load_manifest(with_parity / "manifest.json")
    (with_parity / man.shards[0].path).unlink()
    lock_dir = with_parity / LOCK_DIR
    lock_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_dir / "group-000000.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        began = time.monotonic()
        with pytest.raises(StorageError, match=r"rebuilding it for over 0\.3 s") as info:
            rebuild_files(str(with_parity), man, 0, [man.shards[0].path], lock_timeout_s=0.3)
        assert info.value.errno == errno.ETIMEDOUT
        assert time.monotonic() - began < 5
    finally:
        os.close(fd)
    assert not (with_parity / man.shards[0].path).exists()


def test_a_symlinked_lock_directory_is_refused(with_parity: pathlib.Path,
                                               tmp_path: pathlib.Path) -> None:  # fmt: skip
    man = load_manifest(with_parity / "manifest.json")
    (with_parity / man.shards[0].path).unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (with_parity / LOCK_DIR).symlink_to(elsewhere)
    with pytest.raises(UsageError, match="is a symlink"):
        rebuild_files(str(with_parity), man, 0, [man.shards[0].path])
    assert list(elsewhere.iterdir()) == []


def test_a_path_of_another_group_is_a_usage_error(with_parity: pathlib.Path) -> None:
    man = load_manifest(with_parity / "manifest.json")
    with pytest.raises(UsageError, match="is no file of parity group 0"):
        rebuild_files(str(with_parity), man, 0, [man.shards[5].path])
