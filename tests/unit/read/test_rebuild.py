"""ParityRebuild outside the dataset (issue 32 section 3): a shard rebuilt from parity for a
dataset the job may not write goes to a private, nameless copy that the resolver serves,
never into the dataset; a writable dataset is still repaired in place."""

from __future__ import annotations

import errno
import os
import pathlib
import random
import shutil
import tempfile
from collections.abc import Callable

import pytest

pytest.importorskip("pyeclib")

from shardio.errors import IntegrityError, StorageError
from shardio.format.manifest import load_manifest
from shardio.packing.run import PackOptions, pack
from shardio.read.reader import ShardReader
from shardio.read.rebuild import SCRATCH_PREFIX, ParityRebuild


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """24 files of 1-2 KB packed with parity 4+2 into shards of ~8 KB."""
    base = tmp_path_factory.mktemp("rebuild")
    rng = random.Random(32)
    for i in range(24):
        folder = base / "tree" / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{i:03d}.bin").write_bytes(rng.randbytes(rng.randrange(1000, 2000)))
    pack(os.fspath(base / "tree"), os.fspath(base / "ds"),
         PackOptions(shard_size_bytes=8192, durable=False, parity="4+2"))  # fmt: skip
    return base / "ds"


@pytest.fixture
def ds(pristine: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    shutil.copytree(pristine, tmp_path / "ds")
    return tmp_path / "ds"


@pytest.fixture
def scratch(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    where = tmp_path / "tmpdir"
    where.mkdir()
    monkeypatch.setenv("TMPDIR", os.fspath(where))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return where


def _snapshot(root: pathlib.Path) -> dict[str, tuple[int, int, int]]:
    return {p.relative_to(root).as_posix(): (p.lstat().st_size, p.lstat().st_mtime_ns,
                                             p.lstat().st_ino)
            for p in [root, *root.rglob("*")]}  # fmt: skip


def _flip(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _whole(packed: ShardReader) -> list[dict[str, object]]:
    return [packed.read_sample(i) for i in range(len(packed))]


def test_a_private_copy_is_served_and_the_dataset_never_written(
    ds: pathlib.Path, pristine: pathlib.Path, scratch: pathlib.Path
) -> None:
    rel = load_manifest(ds / "manifest.json").shards[1].path
    _flip(ds / rel)
    before = _snapshot(ds)
    with ShardReader(pristine) as good:
        want = _whole(good)
    with ShardReader(ds) as packed:
        hook = ParityRebuild(packed, in_place=False)
        assert hook(1) is True and hook.wrote and hook.aside
        path = packed.shard_path(1)
        assert path.startswith(f"/proc/{os.getpid()}/fd/")
        assert os.readlink(path).endswith(" (deleted)")  # no name left anywhere
        assert list(scratch.iterdir()) == []
        packed.resolver.forget(1)  # what a retry does: the copy is still served
        assert packed.shard_path(1) == path
        assert _whole(packed) == want
        fd = int(path.rsplit("/", 1)[1])
        hook(1)  # again (a copy that went bad): the old copy is closed
        with pytest.raises(OSError) as old:
            os.fstat(fd)
        assert old.value.errno == errno.EBADF
        fd = int(packed.shard_path(1).rsplit("/", 1)[1])
    with pytest.raises(OSError):  # closed with the reader
        os.fstat(fd)
    assert _snapshot(ds) == before
    assert (ds / rel).read_bytes() != (pristine / rel).read_bytes()  # still bad: not written


def test_a_writable_dataset_is_still_repaired_in_place(
    ds: pathlib.Path, pristine: pathlib.Path, scratch: pathlib.Path
) -> None:
    rel = load_manifest(ds / "manifest.json").shards[2].path
    (ds / rel).unlink()
    with ShardReader(ds) as packed:
        hook = ParityRebuild(packed)
        assert hook(2) is True and hook.wrote and not hook.aside
        assert packed.shard_path(2) == os.path.join(packed.root, rel)
    assert (ds / rel).read_bytes() == (pristine / rel).read_bytes()
    assert list(scratch.iterdir()) == []


def test_the_private_copy_goes_to_the_staging_area_in_use(
    ds: pathlib.Path, tmp_path: pathlib.Path, scratch: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    area = tmp_path / "area"
    area.mkdir()
    made: list[str] = []
    real = tempfile.mkdtemp

    def spy(*args: object, **kwargs: object) -> str:
        made.append(real(*args, **kwargs))  # type: ignore[call-overload]
        assert oct(os.stat(made[-1]).st_mode & 0o777) == "0o700"
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", spy)
    _flip(ds / load_manifest(ds / "manifest.json").shards[0].path)
    with ShardReader(ds, stage=area) as packed:
        monkeypatch.setattr(packed.resolver, "cache_problem", None)  # an area in use
        assert ParityRebuild(packed, in_place=False)(0)
        packed.read_sample(0)
    assert [os.path.dirname(m) for m in made] == [os.fspath(area)]
    assert os.path.basename(made[0]).startswith(SCRATCH_PREFIX)
    assert list(area.iterdir()) == [] and list(scratch.iterdir()) == []


def test_a_group_beyond_repair_fails_and_leaves_nothing(
    ds: pathlib.Path, scratch: pathlib.Path
) -> None:
    man = load_manifest(ds / "manifest.json")
    assert man.parity is not None
    group = man.parity.groups[0]
    for i in group.shards[:3]:  # three losses, two parity files
        (ds / man.shards[i].path).unlink()
    before = _snapshot(ds)
    with ShardReader(ds) as packed:
        with pytest.raises(IntegrityError):
            ParityRebuild(packed, in_place=False)(group.shards[0])
        assert packed.shard_path(group.shards[0]) == os.path.join(
            packed.root, man.shards[group.shards[0]].path
        )
    assert list(scratch.iterdir()) == []
    assert _snapshot(ds) == before


def test_a_full_scratch_disk_is_a_storage_error_naming_the_place(
    ds: pathlib.Path, scratch: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: object, **kwargs: object) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "mkdtemp", full)
    _flip(ds / load_manifest(ds / "manifest.json").shards[0].path)
    with ShardReader(ds) as packed:
        with pytest.raises(StorageError, match=r"private directory.*No space") as exc:
            ParityRebuild(packed, in_place=False)(0)
        assert exc.value.errno == errno.ENOSPC


def test_the_copies_held_are_bounded(
    ds: pathlib.Path, pristine: pathlib.Path, scratch: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the bound the oldest copy is closed and its shard read from its source again."""
    monkeypatch.setattr("shardio.read.resolver.MAX_REBUILT_COPIES", 1)
    man = load_manifest(ds / "manifest.json")
    for i in (0, 1):
        _flip(ds / man.shards[i].path)
    with ShardReader(ds) as packed:
        hook = ParityRebuild(packed, in_place=False)
        for i in (0, 1):
            assert hook(i)
        assert [packed.resolver.rebuilt(i) for i in (0, 1)] == [False, True]
        assert packed.shard_path(0) == os.path.join(packed.root, man.shards[0].path)
        with ShardReader(pristine) as good:
            first = man.shards[1].first_sample
            assert packed.read_sample(first) == good.read_sample(first)


def _in_child(check: Callable[[], bool]) -> bool:
    """Run ``check`` in a forked child; whether it returned True."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            ok = check()
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def test_a_forked_worker_reads_the_copy_only_while_its_descriptor_is_that_copy(
    ds: pathlib.Path, pristine: pathlib.Path, scratch: pathlib.Path
) -> None:
    man = load_manifest(ds / "manifest.json")
    _flip(ds / man.shards[1].path)
    first = man.shards[1].first_sample
    with ShardReader(pristine) as good:
        want = good.read_sample(first)
    with ShardReader(ds) as packed:
        assert ParityRebuild(packed, in_place=False)(1)
        fd = int(packed.shard_path(1).rsplit("/", 1)[1])

        def inherited() -> bool:
            return packed.resolver.rebuilt(1) and packed.read_sample(first) == want

        def reused() -> bool:  # the child closed the number and opened something else there
            other = os.open(os.devnull, os.O_RDONLY)
            os.dup2(other, fd)  # that number now names another file (whatever holes there are)
            os.close(other)
            return not packed.resolver.rebuilt(1) and packed.shard_path(1).startswith(os.fspath(ds))

        assert _in_child(inherited)
        assert _in_child(reused)
        assert packed.read_sample(first) == want  # the parent's copy is untouched
