"""Parity end to end through the CLI: ``pack --parity K+M`` (with --workers, --part + merge,
--resume), ``verify`` and ``verify --repair`` rebuilding every loss pattern of up to M files
of a group (first group, short last group; data, parity and cell tables; deleted, flipped,
truncated) byte for byte, more than M reported and never guessed at, ``parity add|drop``
(on datasets of formats 1 and 2 too), ``stage`` and ``ResilientDataset`` rebuilding a bad
source shard, and hostile input: bad schemes, symlinks, FIFOs, foreign files, another
dataset's parity."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from typing import Any

import pytest
from trees import tree_files

pytest.importorskip("pyeclib")

from shardio.format.manifest import load_manifest

W1 = ("--workers", "1", "--no-progress")
DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def manifest_of(root: pathlib.Path) -> Any:
    return load_manifest(root / "manifest.json")


def files(root: pathlib.Path) -> dict[str, bytes]:
    """The dataset's files, without the rebuild locks (empty files a rebuild leaves)."""
    return {k: v for k, v in tree_files(root).items() if not k.startswith("parity/.locks/")}


@pytest.fixture(scope="module")
def packed(small_tree: pathlib.Path, tmp_path_factory: pytest.TempPathFactory, run_cli: Any):
    """The small tree packed with --parity 4+2 (2 workers) and without parity."""
    out = tmp_path_factory.mktemp("parity")
    with_parity, plain = out / "p", out / "plain"
    r = run_cli("pack", small_tree, with_parity, "--shard-size", "256KiB", "--parity", "4+2",
                "--workers", "2", "--no-progress")  # fmt: skip
    assert r.rc == 0, r.stderr
    assert "parity: 4+2, " in r.stdout and "groups" in r.stdout
    r = run_cli("pack", small_tree, plain, "--shard-size", "256KiB", *W1)
    assert r.rc == 0, r.stderr
    return with_parity, plain


@pytest.fixture
def ds(packed: tuple[pathlib.Path, pathlib.Path], tmp_path: pathlib.Path) -> pathlib.Path:
    dst = tmp_path / "ds"
    shutil.copytree(packed[0], dst)
    return dst


def test_pack_writes_groups_whose_data_shards_are_unchanged(
    packed: tuple[pathlib.Path, pathlib.Path], run_cli: Any
) -> None:
    with_parity, plain = packed
    man = manifest_of(with_parity)
    assert man.format_version == 3 and man.parity is not None
    n = len(man.shards)
    assert n >= 10 and n % 4 != 0, n  # a short last group
    assert [g.num_shards for g in man.parity.groups] == [4] * (n // 4) + [n % 4]
    for g, group in enumerate(man.parity.groups):
        longest = max(man.shards[i].size_bytes for i in group.shards)
        assert [p.size_bytes for p in group.parity] == [longest, longest]
        assert group.cells.path == f"parity/group-{g:06d}.cells"
    # The data shards, their DALI indexes and the index are the bytes packing without
    # parity writes: webdataset, DALI, tar and h5py read them as before.
    a, b = files(with_parity), files(plain)
    assert {k: v for k, v in a.items() if k.startswith("shards/")} == {
        k: v for k, v in b.items() if k.startswith("shards/")
    }
    assert a["index.bin"] == b["index.bin"]
    with tarfile.open(with_parity / man.shards[0].path) as tf:
        assert all(not n.startswith("parity") for n in tf.getnames())
    r = run_cli("verify", with_parity, *W1)
    assert r.rc == 0, r.stderr
    assert f"OK: verified {n} shards and {len(man.parity.files())} parity files" in r.stdout
    info = run_cli("inspect", with_parity, "--json")
    assert json.loads(info.stdout)["parity"]["scheme"] == "4+2"
    text = run_cli("inspect", with_parity).stdout
    assert f"parity        4+2 in {len(man.parity.groups)} groups" in text
    assert "parity        none (shardio parity add" in run_cli("inspect", plain).stdout


def _damage(root: pathlib.Path, rel: str, how: str) -> None:
    path = root / rel
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        os.truncate(path, path.stat().st_size // 3)
    else:
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x20
        path.write_bytes(raw)


def _group_files(root: pathlib.Path, g: int) -> list[str]:
    man = manifest_of(root)
    group = man.parity.groups[g]
    return [man.shards[i].path for i in group.shards] + [p.path for p in group.files()]


@pytest.mark.parametrize("which", ["first", "last"])
def test_every_loss_of_up_to_m_files_of_a_group_is_rebuilt_byte_for_byte(
    ds: pathlib.Path, which: str, run_cli: Any
) -> None:
    """Through the library, pattern after pattern (the CLI's wording: the first one and the
    other tests here)."""
    from shardio.tools.repair import repair_dataset
    from shardio.tools.verify import verify_dataset

    original = files(ds)
    g = 0 if which == "first" else len(manifest_of(ds).parity.groups) - 1
    members = _group_files(ds, g)
    hows = itertools.cycle(["delete", "flip", "truncate"])
    patterns = [c for n in (1, 2) for c in itertools.combinations(members, n)]
    assert len(patterns) >= 10
    for n, pattern in enumerate(patterns):
        for rel in pattern:
            _damage(ds, rel, next(hows))
        if n == 0:
            r = run_cli("verify", ds, "--repair", *W1)
            assert r.rc == 4 and f"repaired {pattern[0]} (" in r.stdout, r.stdout + r.stderr
        else:
            found = verify_dataset(ds)
            assert {p.path for p in found.problems} == set(pattern)
            assert found.status in ("damaged", "degraded")
            report = repair_dataset(ds)
            assert report.status == "repaired", (pattern, report.unrepaired)
            assert sorted(r.path for r in report.repaired) == sorted(pattern)
            assert all(f"parity group {g}" in r.how for r in report.repaired)
        assert files(ds) == original, pattern


def test_more_losses_than_parity_are_reported_and_the_rest_repaired(
    ds: pathlib.Path, run_cli: Any
) -> None:
    original = files(ds)
    lost = _group_files(ds, 0)[:3]  # three data shards of a 4+2 group
    for rel in lost:
        (ds / rel).unlink()
    _damage(ds, _group_files(ds, 1)[0], "flip")
    r = run_cli("verify", ds, *W1)
    assert r.rc == 3
    assert "parity can rebuild 1 of the damaged shards" in r.stderr
    assert "parity group(s) 0 lost more files than their parity" in r.stderr
    r = run_cli("verify", ds, "--repair", *W1)
    assert r.rc == 3, r.stdout
    assert f"repaired {_group_files(ds, 1)[0]} (damaged): rebuilt from parity group 1" in r.stdout
    for rel in lost:
        assert f"could not repair {rel}: missing; parity group 0 could not rebuild it" in r.stderr
        assert not (ds / rel).exists()  # nothing guessed, nothing half-written
    assert "3 files of one group lost" in r.stderr
    now = files(ds)
    assert {k: v for k, v in now.items() if k not in lost} == {
        k: v for k, v in original.items() if k not in lost
    }


def test_a_corrupted_parity_file_never_rewrites_a_good_shard(
    ds: pathlib.Path, run_cli: Any
) -> None:
    """Only the bad file is written: good data shards keep their inode and bytes."""
    man = manifest_of(ds)
    p0 = man.parity.groups[0].parity[0].path
    _damage(ds, p0, "flip")
    inodes = {s.path: (ds / s.path).stat().st_ino for s in man.shards}
    r = run_cli("verify", ds, *W1)
    assert r.rc == 5 and "DEGRADED: 1 of" in r.stderr and "every data shard is intact" in r.stderr
    r = run_cli("verify", ds, "--repair", *W1)
    assert r.rc == 4 and "REPAIRED: repaired 1 parity file" in r.stdout
    assert {s.path: (ds / s.path).stat().st_ino for s in man.shards} == inodes


def test_parity_add_and_drop(packed: tuple[pathlib.Path, pathlib.Path], tmp_path: pathlib.Path,
                             run_cli: Any) -> None:  # fmt: skip
    with_parity, plain = packed
    dst = tmp_path / "ds"
    shutil.copytree(plain, dst)
    before = files(dst)
    r = run_cli("parity", "add", dst, "--parity", "4+2", "--workers", "2")
    assert r.rc == 0, r.stderr
    assert r.stdout.startswith(f"added parity 4+2 to {dst}: ")
    added = files(dst)
    # The parity files are exactly what pack --parity writes for the same shards.
    assert {k: v for k, v in added.items() if k.startswith("parity/")} == {
        k: v for k, v in files(with_parity).items() if k.startswith("parity/")
    }
    kept = {k: v for k, v in added.items() if not k.startswith("parity/")}
    assert {k: v for k, v in kept.items() if k != "manifest.json"} == {
        k: v for k, v in before.items() if k != "manifest.json"
    }
    assert run_cli("parity", "add", dst, "--parity", "4+2").stdout.endswith(
        "already has parity 4+2: nothing to do\n"
    )
    r = run_cli("parity", "add", dst, "--parity", "2+1")
    assert r.rc == 2 and "has parity 4+2 already: drop it first" in r.stderr
    assert not (dst / ".shardio-work").exists()
    r = run_cli("parity", "drop", dst)
    assert r.rc == 0 and r.stdout.startswith(f"dropped parity 4+2 from {dst}: removed ")
    dropped = files(dst)
    assert not (dst / "parity").exists()
    assert {k: v for k, v in dropped.items() if k != "manifest.json"} == {
        k: v for k, v in before.items() if k != "manifest.json"
    }
    assert manifest_of(dst).parity is None
    assert run_cli("verify", dst, *W1).rc == 0
    assert run_cli("parity", "drop", dst).stdout.endswith("has no parity: nothing to do\n")


@pytest.mark.parametrize("version", ["format_v1", "format_v2"])
def test_parity_add_upgrades_an_older_dataset_to_format_3(
    version: str, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    dst = tmp_path / "ds"
    shutil.copytree(DATA / version / "tar", dst)
    r = run_cli("parity", "add", dst, "--parity", "1+1")
    assert r.rc == 0, r.stderr
    man = manifest_of(dst)
    assert man.format_version == 3 and man.parity is not None
    assert all(s.index_xxh3_64 for s in man.shards)  # format 1 kept none: sealed now
    original = files(dst)
    (dst / man.shards[1].path).unlink()
    assert run_cli("verify", dst, "--repair", *W1).rc == 4
    assert files(dst) == original


def test_part_and_merge_and_resume(small_tree: pathlib.Path, tmp_path: pathlib.Path,
                                   packed: tuple[pathlib.Path, pathlib.Path],
                                   run_cli: Any) -> None:  # fmt: skip
    dst = tmp_path / "parts"
    common = ("--shard-size", "256KiB", "--parity", "4+2", *W1)
    for part in ("0/2", "1/2"):
        r = run_cli("pack", small_tree, dst, "--part", part, *common)
        assert r.rc == 0, r.stderr
    assert not (dst / "parity").exists() or not any((dst / "parity").iterdir())
    r = run_cli("merge", dst, "--workers", "2", "--no-progress")
    assert r.rc == 0, r.stderr
    man = manifest_of(dst)
    assert man.parity is not None and man.parity.scheme == "4+2"
    assert len(man.parity.groups) == -(-len(man.shards) // 4)  # groups across the parts
    assert run_cli("verify", dst, *W1).rc == 0
    r = run_cli("pack", small_tree, packed[0], "--resume", "--shard-size", "256KiB",
                "--parity", "4+2", *W1)  # fmt: skip
    assert r.rc == 0 and "already complete" in r.stdout
    r = run_cli("pack", small_tree, packed[0], "--resume", "--shard-size", "256KiB", *W1)
    assert r.rc != 0 and "the source or the options changed" in r.stderr  # parity is an option
    r = run_cli("pack", small_tree, tmp_path / "mixed", "--part", "0/2", *common)
    assert r.rc == 0
    r = run_cli("pack", small_tree, tmp_path / "mixed", "--part", "1/2", "--shard-size",
                "256KiB", *W1)  # fmt: skip
    assert r.rc != 0 and "plan" in r.stderr  # a part without --parity is another plan


def _listing(root: pathlib.Path) -> dict[str, tuple[int, int, int, int]]:
    """Every path under root (hidden ones, directories included): (size, mtime, ctime, inode).
    The ctime moves with any write, rename over or chmod."""
    out = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                                            st.st_ino)  # fmt: skip
    return out


def test_stage_rebuilds_a_bad_source_shard(ds: pathlib.Path, tmp_path: pathlib.Path,
                                           run_cli: Any) -> None:  # fmt: skip
    """The rebuild goes into the staging area; nothing under the source is written (no
    shard, no lock, no temp), even where it could be."""
    original = files(ds)
    man = manifest_of(ds)
    (ds / man.shards[2].path).unlink()
    _damage(ds, man.shards[7].path, "flip")
    before = _listing(ds)
    area = tmp_path / "area"
    r = run_cli("stage", ds, area, "--no-progress")
    assert r.rc == 0, r.stderr
    assert "rebuilding it from parity into" in r.stderr
    assert _listing(ds) == before  # the source untouched
    assert run_cli("verify", area, *W1).rc == 0
    for i in (2, 7):
        assert (area / man.shards[i].path).read_bytes() == original[man.shards[i].path]
    assert {k: v for k, v in files(area).items() if k.startswith("shards/")} == {
        k: v for k, v in original.items() if k.startswith("shards/")
    }


@contextlib.contextmanager
def _read_only(ds: pathlib.Path, tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    """Shared training data: ``ds`` without write permission, seen through a read-only bind
    mount (root ignores the permission bits, not the mount)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a read-only bind mount needs root and mount(8)")
    for path in [ds, *ds.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    ro = tmp_path / "ro"
    ro.mkdir()
    proc = subprocess.run(["mount", "--bind", "-o", "ro", str(ds), str(ro)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    try:
        if proc.returncode != 0:
            pytest.skip(f"cannot make a read-only bind mount: {proc.stderr.strip()}")
        with pytest.raises(OSError):
            (ro / "probe").write_bytes(b"")  # the mount refuses writes, even root's
        yield ro
    finally:
        if proc.returncode == 0:
            subprocess.run(["umount", "-l", str(ro)], check=False)
        for path in [ds, *ds.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)


def test_stage_rebuilds_from_a_read_only_source(ds: pathlib.Path, tmp_path: pathlib.Path,
                                                run_cli: Any) -> None:  # fmt: skip
    """Its parity still heals the staged copies of a source nobody may write."""
    original = files(ds)
    man = manifest_of(ds)
    (ds / man.shards[0].path).unlink()
    _damage(ds, man.shards[5].path, "truncate")
    with _read_only(ds, tmp_path) as ro:
        before = _listing(ro)
        area = tmp_path / "area"
        r = run_cli("stage", ro, area, "--no-progress")
        assert r.rc == 0, r.stderr
        assert _listing(ro) == before
        assert run_cli("verify", area, *W1).rc == 0
        for i in (0, 5):
            assert (area / man.shards[i].path).read_bytes() == original[man.shards[i].path]
        # A second run finds the rebuilt copies staged: nothing to copy or rebuild.
        r = run_cli("stage", ro, area, "--no-progress")
        assert r.rc == 0 and "rebuilding" not in r.stderr, r.stderr


def test_a_reader_restages_from_the_parity_of_a_read_only_source(
    ds: pathlib.Path, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    """ResilientDataset over a staging area: a staged copy goes bad and its source shard is
    gone too; the re-stage rebuilds it from the source's parity into the area."""
    from shardio import RecoveryPolicy, ShardDataset

    original = files(ds)
    man = manifest_of(ds)
    rel = man.shards[3].path
    with _read_only(ds, tmp_path) as ro:
        area = tmp_path / "area"
        assert run_cli("stage", ro, area, "--no-progress").rc == 0
        subprocess.run(["umount", "-l", str(ro)], check=True)
        (ds / rel).unlink()  # lost at the source (written before it is read-only again)
        subprocess.run(["mount", "--bind", "-o", "ro", str(ds), str(ro)], check=True)
        _damage(area, rel, "flip")  # bit rot in the staged copy
        before = _listing(ro)
        read = ShardDataset(area, recovery=RecoveryPolicy(policy="raise", retries=0))
        keys = [read[i]["__key__"] for i in range(len(read))]
        assert len(keys) == man.num_samples and len(set(keys)) == len(keys)
        assert read.recovery_stats["skip"] == 0
        assert (area / rel).read_bytes() == original[rel]
        assert _listing(ro) == before
        assert not (ro / rel).exists()


def _inputs(tree: pathlib.Path) -> dict[str, bytes]:
    """The packed tree's files by sample key (its path without the suffix)."""
    return {p.relative_to(tree).with_suffix("").as_posix(): p.read_bytes()
            for p in tree.rglob("*") if p.is_file()}  # fmt: skip


def _scratch_open() -> list[str]:
    """The files this process holds open in a rebuild's private directory."""
    from shardio.read.rebuild import SCRATCH_PREFIX

    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if SCRATCH_PREFIX in (target := os.readlink(f"/proc/self/fd/{fd}")):
                held.append(target)
    return held


@pytest.fixture
def scratch(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """$TMPDIR for this test (where a rebuild outside a read-only dataset goes)."""
    import tempfile

    where = tmp_path / "tmpdir"
    where.mkdir()
    monkeypatch.setenv("TMPDIR", str(where))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads $TMPDIR again
    return where


@pytest.mark.parametrize("access", ["told", "refused"])
def test_a_read_only_source_shard_is_rebuilt_aside_and_read_whole(
    ds: pathlib.Path, tmp_path: pathlib.Path, small_tree: pathlib.Path, scratch: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch, access: str,
) -> None:  # fmt: skip
    """ResilientDataset over a read-only mount of a dataset with a corrupted shard: its
    parity still gives the whole epoch, byte for byte, and nothing is written under it; the
    private copy has no name from the start and is freed at close. "refused": the dataset
    looks writable (os.access is asked, and lies) and the in-place rebuild is refused."""
    from shardio import RecoveryPolicy, ShardDataset

    man = manifest_of(ds)
    _damage(ds, man.shards[3].path, "flip")
    inputs = _inputs(small_tree)
    with _read_only(ds, tmp_path) as ro:
        before = _listing(ro)
        if access == "refused":
            monkeypatch.setattr("shardio.read.rebuild.os.access", lambda *a, **k: True)
        read = ShardDataset(ro, recovery=RecoveryPolicy(policy="raise", retries=0))
        got = {}
        for i in range(len(read)):
            sample = read[i]
            got[sample["__key__"]] = sample["jpeg"]
        assert got == inputs  # every sample, every byte
        assert read.recovery_stats["rebuild"] == 1 and read.recovery_stats["skip"] == 0
        assert list(scratch.iterdir()) == []  # its name was removed at once
        held = _scratch_open()  # the copy, held open and read from
        assert held and all(h.endswith(f"{man.shards[3].path} (deleted)") for h in held), held
        read.close()
        assert _scratch_open() == []  # freed at close
        assert _listing(ro) == before  # size, mtime, ctime and inode of every path


def test_a_read_only_source_shard_is_rebuilt_aside_by_each_dataloader_worker(
    ds: pathlib.Path, tmp_path: pathlib.Path, small_tree: pathlib.Path, scratch: pathlib.Path
) -> None:
    """The same through a map-mode DataLoader with 2 workers: each worker that meets the
    bad shard rebuilds its own private copy; the epoch is whole and the source unwritten."""
    from shardio import RecoveryPolicy, ShardDataset, ShardLoader

    man = manifest_of(ds)
    _damage(ds, man.shards[1].path, "truncate")
    _damage(ds, man.shards[6].path, "flip")
    inputs = _inputs(small_tree)
    with _read_only(ds, tmp_path) as ro:
        before = _listing(ro)
        read = ShardDataset(
            ro, mode="map", seed=3, recovery=RecoveryPolicy(policy="raise", retries=0)
        )
        loader = ShardLoader(read, batch_size=16, num_workers=2)
        got = {}
        for batch in loader:
            for key, payload in zip(batch["__key__"], batch["jpeg"], strict=True):
                got[key] = bytes(payload)
        assert got == inputs
        stats = read.recovery_stats
        assert stats["rebuild"] >= 2 and stats["skip"] == 0 and stats["raise"] == 0, stats
        read.close()
        assert list(scratch.iterdir()) == []
        assert _listing(ro) == before


def test_resilient_dataset_rebuilds_from_parity(ds: pathlib.Path) -> None:
    from shardio import RecoveryPolicy, ShardDataset

    original = files(ds)
    man = manifest_of(ds)
    (ds / man.shards[0].path).unlink()
    _damage(ds, man.shards[-1].path, "truncate")
    read = ShardDataset(ds, recovery=RecoveryPolicy(policy="raise", retries=0))
    keys = [read[i]["__key__"] for i in range(len(read))]
    assert len(keys) == man.num_samples and len(set(keys)) == len(keys)
    assert read.recovery_stats["rebuild"] == 2 and read.recovery_stats["skip"] == 0
    assert files(ds) == original


def test_a_caller_hook_replaces_the_parity_rebuild(ds: pathlib.Path) -> None:
    from shardio import RecoveryPolicy, ShardDataset
    from shardio.errors import SampleUnavailableError

    (ds / manifest_of(ds).shards[0].path).unlink()
    calls: list[int] = []
    read = ShardDataset(
        ds,
        recovery=RecoveryPolicy(policy="raise", retries=0),
        rebuild=lambda shard: calls.append(shard) or False,
    )
    with pytest.raises(SampleUnavailableError, match="could not rebuild"):
        read[0]
    assert calls == [0]


# --------------------------------------------------------------------------- hostile


@pytest.mark.parametrize(
    "scheme",
    [
        "0+1",
        "2+3",
        "65+1",
        "4+17",
        "abc",
        "4+",
        "+2",
        "4-2",
        "1e3+1",
        "99999999999+1",
        "",
        "\uff14+\uff12",
        "4 + 2",
        "nan+1",
    ],
)
def test_bad_schemes_are_one_line_usage_errors(
    small_tree: pathlib.Path, tmp_path: pathlib.Path, scheme: str, run_cli: Any,
    run_cli_here: Any, assert_cli_error: Any,
) -> None:  # fmt: skip
    run = run_cli if scheme == "abc" else run_cli_here  # one through the command
    r = run("pack", small_tree, tmp_path / "ds", "--parity", scheme, *W1)
    assert_cli_error(r, "parity")
    assert r.rc == 2
    assert not (tmp_path / "ds").exists()


def test_symlinks_fifos_and_foreign_files_at_parity_paths_are_refused(
    packed: tuple[pathlib.Path, pathlib.Path], ds: pathlib.Path, tmp_path: pathlib.Path,
    run_cli: Any, assert_cli_error: Any,
) -> None:  # fmt: skip
    victim = tmp_path / "victim"
    victim.write_bytes(b"not shardio's")
    plain = tmp_path / "plain"
    for setup, needle in [
        (lambda p: (p / "parity").symlink_to(tmp_path), "is a symlink"),
        (lambda p: ((p / "parity").mkdir(), (p / "parity/group-000000.p0").symlink_to(victim)),
         "not a regular file"),
        (lambda p: ((p / "parity").mkdir(), (p / "parity/group-000001.cells").write_bytes(b"x")),
         "no parity run of shardio recorded writing it"),
        (lambda p: ((p / "parity").mkdir(), os.mkfifo(p / "parity/group-000000.p1")),
         "not a regular file"),
    ]:  # fmt: skip
        if plain.exists():
            shutil.rmtree(plain)
        shutil.copytree(packed[1], plain)
        setup(plain)
        r = run_cli("parity", "add", plain, "--parity", "4+2")
        assert_cli_error(r, needle)
        assert victim.read_bytes() == b"not shardio's"
        assert manifest_of(plain).parity is None
    # A symlink where a lost parity file is rebuilt: refused, never written through.
    p0 = manifest_of(ds).parity.groups[0].parity[0].path
    (ds / p0).unlink()
    (ds / p0).symlink_to(victim)
    r = run_cli("verify", ds, "--repair", *W1)
    assert r.rc == 5 and "not a shard shardio wrote" in r.stderr  # parity only: degraded
    assert victim.read_bytes() == b"not shardio's" and (ds / p0).is_symlink()


def test_another_datasets_parity_is_never_used(
    ds: pathlib.Path, tmp_path: pathlib.Path, small_tree: pathlib.Path, run_cli: Any
) -> None:
    """Parity files of a second dataset packed the same way from another tree, copied in:
    verify flags them, and a lost shard is not rebuilt from them (no wrong bytes)."""
    other_src = tmp_path / "other"
    shutil.copytree(small_tree, other_src)
    victim = sorted(p for p in other_src.rglob("*") if p.is_file())[0]
    victim.write_bytes(victim.read_bytes()[::-1])
    other = tmp_path / "other-ds"
    assert run_cli("pack", other_src, other, "--shard-size", "256KiB", "--parity", "4+2",
                   *W1).rc == 0  # fmt: skip
    shutil.rmtree(ds / "parity")
    shutil.copytree(other / "parity", ds / "parity")
    lost = manifest_of(ds).shards[0].path
    (ds / lost).unlink()
    r = run_cli("verify", ds, "--repair", *W1)
    assert r.rc == 3
    assert f"could not repair {lost}" in r.stderr
    assert not (ds / lost).exists()


def test_force_replaces_a_dataset_with_parity_by_one_with_or_without(
    small_tree: pathlib.Path, ds: pathlib.Path, run_cli: Any
) -> None:
    (ds / manifest_of(ds).shards[0].path).unlink()
    assert run_cli("verify", ds, "--repair", *W1).rc == 4  # leaves parity/.locks/ behind
    r = run_cli("pack", small_tree, ds, "--shard-size", "512KiB", "--force", *W1)
    assert r.rc == 0, r.stderr
    man = manifest_of(ds)
    assert man.parity is None
    assert not list(ds.glob("parity/group-*"))
    r = run_cli("pack", small_tree, ds, "--shard-size", "512KiB", "--force", "--parity", "2+1",
                *W1)  # fmt: skip
    assert r.rc == 0, r.stderr
    assert manifest_of(ds).parity is not None
    assert run_cli("verify", ds, *W1).rc == 0


def test_two_runs_at_once_are_refused_in_one_line(
    ds: pathlib.Path, run_cli: Any, assert_cli_error: Any
) -> None:
    import fcntl

    fd = os.open(ds, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a pack or repair holds it
        for argv in (("parity", "add", ds, "--parity", "4+2"), ("parity", "drop", ds),
                     ("verify", ds, "--repair", *W1)):  # fmt: skip
            assert_cli_error(run_cli(*argv), "is writing to", str(ds))
    finally:
        os.close(fd)
    assert manifest_of(ds).parity is not None


def test_verify_json_reports_parity(ds: pathlib.Path, run_cli: Any) -> None:
    man = manifest_of(ds)
    (ds / man.shards[1].path).unlink()
    (ds / man.parity.groups[1].parity[0].path).unlink()
    r = run_cli("verify", ds, "--json", *W1)
    doc = json.loads(r.stdout)
    assert r.rc == 3 and doc["status"] == "damaged"
    assert doc["parity_checked"] == len(man.parity.files())
    assert doc["rebuildable"] == [man.shards[1].path]
    assert doc["parity_groups_over_parity"] == []
    kinds = {p["shard"]: p["parity"] for p in doc["problems"]}
    assert kinds == {man.shards[1].path: False, man.parity.groups[1].parity[0].path: True}
    r = run_cli("verify", ds, "--repair", "--json", *W1)
    doc = json.loads(r.stdout)
    assert r.rc == 4 and doc["status"] == "repaired" and doc["repair_source"] == "parity"
    assert len(doc["repaired"]) == 2
