"""unpack_dataset: long names, nothing half written on failure, and hostile indexes refused.

Edits of an index use the format-1 golden set: its manifest has no checksum of its own, so a
test can re-point the index checksum at the edited index and reach unpack's own checks (in
format 2 the per-shard index checksums catch an edit first, which a test here also shows).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat

import pytest
import xxhash
from trees import read_tree, write_tree

from shardio.errors import (
    ChecksumMismatchError,
    FormatError,
    ShardioError,
    StorageError,
    UsageError,
)
from shardio.packing.run import PackOptions, pack
from shardio.read.reader import ShardReader
from shardio.tools.unpack import unpack_dataset

GOLDEN_V1 = pathlib.Path(__file__).resolve().parents[2] / "data" / "format_v1" / "tar"
GOLDEN_TREE = {
    b"cat/0001.bin",
    b"cat/0001.json",
    b"cat/img 2.v1.BIN",
    b"dog/0003.bin",
    b"dog/no_ext",
}


def pack_tree(tmp_path: pathlib.Path, files: dict[bytes, bytes], **options: object) -> str:
    """Pack ``files`` (unlabelled unless told) into tmp_path/ds; return the dataset path."""
    src = write_tree(tmp_path / "src", files)
    dst = os.fspath(tmp_path / "ds")
    opts = {"durable": False, "labels": "none", **options}
    pack(src, dst, PackOptions(**opts))  # type: ignore[arg-type]
    return dst


def entries(path: pathlib.Path) -> list[str]:
    """Names in a directory, hidden ones included, sorted."""
    return sorted(os.listdir(path))


# ----------------------------------------------------------------------------- long names


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
@pytest.mark.parametrize("length", [237, 250, 255])
def test_names_up_to_name_max_round_trip(fmt: str, length: int, tmp_path: pathlib.Path) -> None:
    """A name of 237-255 bytes packs; unpack must restore it too (its temp name is short)."""
    long = b"n" * (length - 4) + b".jpg"
    files = {b"d/" + long: os.urandom(500), b"d/" + b"\xe9" * (length - 4) + b".bin": b"x"}
    dst = pack_tree(tmp_path, files, shard_format=fmt)
    out = tmp_path / "out"
    result = unpack_dataset(dst, out)
    assert result.files == 2
    assert read_tree(out) == files
    assert entries(tmp_path) == ["ds", "out", "src"]


def test_out_with_a_name_max_name(tmp_path: pathlib.Path) -> None:
    """OUT's own name may be 255 bytes: the private directory beside it stays within NAME_MAX."""
    files = {b"a/b.txt": b"hello"}
    dst = pack_tree(tmp_path, files)
    out = tmp_path / ("o" * 255)
    unpack_dataset(dst, out)
    assert read_tree(out) == files
    assert entries(tmp_path) == sorted(["ds", "src", "o" * 255])


# ------------------------------------------------------------------- nothing half written


@pytest.fixture
def several_shards(tmp_path: pathlib.Path) -> str:
    """Twelve files of 3 KiB in 8 KiB shards: several shards, written in order."""
    files = {f"c{i % 3}/f{i:02d}.bin".encode(): os.urandom(3000) for i in range(12)}
    return pack_tree(tmp_path, files, shard_size_bytes=8 * 1024)


def _last_shard(dst: str) -> str:
    with ShardReader(dst) as ds:
        assert len(ds.manifest.shards) >= 3
        return os.path.join(dst, ds.manifest.shards[-1].path)


def _damage(dst: str, how: str) -> type[ShardioError]:
    shard = _last_shard(dst)
    if how == "truncated":
        os.truncate(shard, os.path.getsize(shard) // 3)
        return StorageError
    with ShardReader(dst) as ds:  # flip a byte in the last sample's first member
        m = ds.index.sample_member_range(len(ds) - 1)[0]
        where = int(ds.index.members[m]["offset"]) + 10
    with open(shard, "r+b") as fh:
        fh.seek(where)
        byte = fh.read(1)
        fh.seek(where)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return ChecksumMismatchError


@pytest.mark.parametrize("how", ["truncated", "flipped"])
def test_failure_mid_unpack_leaves_no_out_and_no_temp(
    how: str, several_shards: str, tmp_path: pathlib.Path
) -> None:
    """Files of the first shards are written before the last shard fails: none may remain,
    under OUT or in a temp directory, and parents the unpack created go too."""
    error = _damage(several_shards, how)
    base = tmp_path / "restore"
    base.mkdir()
    out = base / "made" / "by" / "unpack"
    with pytest.raises(error) as info:
        unpack_dataset(several_shards, out)
    assert os.path.basename(_last_shard(several_shards)) in str(info.value)
    assert entries(base) == []


def test_failure_keeps_an_empty_out_as_it_was(several_shards: str, tmp_path: pathlib.Path) -> None:
    _damage(several_shards, "truncated")
    out = tmp_path / "out"
    out.mkdir(mode=0o750)
    os.chmod(out, 0o750)
    before = os.stat(out)
    with pytest.raises(StorageError):
        unpack_dataset(several_shards, out)
    after = os.stat(out)
    assert entries(out) == []
    assert (after.st_ino, stat.S_IMODE(after.st_mode)) == (before.st_ino, 0o750)
    assert entries(tmp_path) == ["ds", "out", "src"]


def test_an_empty_out_is_filled_and_keeps_its_mode(tmp_path: pathlib.Path) -> None:
    files = {b"x/1.txt": b"one", b"y/2.txt": b"two"}
    dst = pack_tree(tmp_path, files)
    out = tmp_path / "out"
    out.mkdir()
    os.chmod(out, 0o710)
    unpack_dataset(dst, out)
    assert read_tree(out) == files
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o710
    assert entries(tmp_path) == ["ds", "out", "src"]


def test_a_symlink_to_an_empty_directory_is_followed(tmp_path: pathlib.Path) -> None:
    files = {b"x/1.txt": b"one"}
    dst = pack_tree(tmp_path, files)
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    unpack_dataset(dst, tmp_path / "link")
    assert (tmp_path / "link").is_symlink()
    assert read_tree(real) == files


@pytest.mark.parametrize("kind", ["non-empty", "file", "dangling", "empty-name", "cwd"])
def test_bad_out_is_refused_and_left_alone(
    kind: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = pack_tree(tmp_path, {b"x/1.txt": b"one"})
    out = tmp_path / "out"
    needle = "out"
    if kind == "non-empty":
        out.mkdir()
        (out / "keep").write_bytes(b"mine")
    elif kind == "file":
        out.write_bytes(b"mine")
    elif kind == "dangling":
        out.symlink_to(tmp_path / "nowhere")
    elif kind == "cwd":
        out.mkdir()
        monkeypatch.chdir(out)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and "ds" not in p.parts}
    target: str | pathlib.Path = out
    if kind == "empty-name":
        target, needle = "", "empty"
    elif kind == "cwd":
        target, needle = ".", "current directory"
    with pytest.raises(UsageError, match=needle):
        unpack_dataset(dst, target)
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and "ds" not in p.parts}
    assert after == before
    assert not [n for n in entries(tmp_path) if ".shardio-tmp-" in n]


def test_out_below_a_file_is_one_storage_error(tmp_path: pathlib.Path) -> None:
    dst = pack_tree(tmp_path, {b"x/1.txt": b"one"})
    (tmp_path / "file").write_bytes(b"mine")
    with pytest.raises(StorageError, match="file/out"):
        unpack_dataset(dst, tmp_path / "file" / "out")
    assert (tmp_path / "file").read_bytes() == b"mine"


# --------------------------------------------------------------------- hostile indexes


@pytest.fixture
def golden_copy(tmp_path: pathlib.Path) -> pathlib.Path:
    dst = tmp_path / "golden"
    shutil.copytree(GOLDEN_V1, dst)
    return dst


def _rewrite_manifest(ds: pathlib.Path, **changes: object) -> None:
    """Set top-level manifest fields and point the index checksum at today's index.bin."""
    doc = json.loads((ds / "manifest.json").read_text())
    doc.update(changes)
    index = (ds / "index.bin").read_bytes()
    doc["index"]["xxh3_128"] = xxhash.xxh3_128_hexdigest(index)
    (ds / "manifest.json").write_text(json.dumps(doc, indent=1))


def _replace_path(ds: pathlib.Path, old: bytes, new: bytes) -> None:
    """Overwrite one original path in index.bin with another of the same length."""
    assert len(old) == len(new)
    data = (ds / "index.bin").read_bytes()
    at = data.rfind(old)  # the paths blob follows the keys blob, where a key may match
    assert at > 0
    (ds / "index.bin").write_bytes(data[:at] + new + data[at + len(old) :])
    _rewrite_manifest(ds)


def test_golden_v1_unpacks(golden_copy: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The edits below start from a dataset that unpacks."""
    result = unpack_dataset(golden_copy, tmp_path / "out")
    assert set(read_tree(tmp_path / "out")) == GOLDEN_TREE
    assert result.files == len(GOLDEN_TREE)


@pytest.mark.parametrize(
    ("old", "new", "needle"),
    [
        (b"cat/0001.bin", b"../00001.bin", "unsafe path '../00001.bin'"),
        (b"dog/no_ext", b"/og/no_ext", "unsafe path '/og/no_ext'"),
        (b"dog/no_ext", b"dog/./_ext", "unsafe path 'dog/./_ext'"),
        (b"dog/no_ext", b"dog//o_ext", "unsafe path 'dog//o_ext'"),
        (b"dog/no_ext", b"dog/no\0ext", "unsafe path 'dog/no\\x00ext'"),
        (b"dog/0003.bin", b"cat/0001.bin", "'cat/0001.bin' twice"),
        (b"cat/0001.json", b"dog/no_ext/ab", "'dog/no_ext' as a file and a directory"),
    ],
)
def test_hostile_index_paths_are_refused_before_writing(
    old: bytes, new: bytes, needle: str, golden_copy: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    _replace_path(golden_copy, old, new)
    with pytest.raises(FormatError) as info:
        unpack_dataset(golden_copy, tmp_path / "out")
    assert needle in str(info.value)
    assert str(golden_copy / "index.bin") in str(info.value)
    assert entries(tmp_path) == ["golden"]


@pytest.mark.parametrize("num_members", [8, 10])
def test_file_count_must_match_the_manifest(
    num_members: int, golden_copy: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """9 members = 5 files + 4 labels: a manifest promising another count is refused, and
    nothing is written (no "unpacked" with a file missing)."""
    _rewrite_manifest(golden_copy, num_members=num_members)
    promised = num_members - 4
    with pytest.raises(FormatError) as info:
        unpack_dataset(golden_copy, tmp_path / "out")
    assert f"lists 5 files to restore, the manifest of {golden_copy} promises {promised}" in str(
        info.value
    )
    assert entries(tmp_path) == ["golden"]


def test_an_edited_index_of_today_fails_cleanly(tmp_path: pathlib.Path) -> None:
    """A file member turned into a label (its path length zeroed) in a format-2 dataset: the
    unpack fails (whichever check sees it first) and writes nothing."""
    files = {b"c/a.bin": b"a" * 100, b"c/b.bin": b"b" * 100}
    dst = pack_tree(tmp_path, files)
    with ShardReader(dst) as ds:
        member = ds.index.sample_member_range(1)[0]
    rec_offset = _member_record_offset(dst, member)
    with open(os.path.join(dst, "index.bin"), "r+b") as fh:
        fh.seek(rec_offset + 32)  # MEMBER_DTYPE: offset, size, xxh3_64, path_offset (8 each)
        fh.write(b"\0\0\0\0")  # path_length
    with pytest.raises(ShardioError, match="index"):
        unpack_dataset(dst, tmp_path / "out")
    assert entries(tmp_path) == ["ds", "src"]


def _member_record_offset(dst: str, member: int) -> int:
    """Byte offset of member record ``member`` in index.bin."""
    from shardio.format.index import MEMBER_DTYPE, Index

    with open(os.path.join(dst, "index.bin"), "rb") as fh:
        data = fh.read()
    index = Index(data, path="index.bin")
    base = data.find(index.members.tobytes())
    assert base > 0
    return base + member * MEMBER_DTYPE.itemsize
