"""Tests for filesystem detection with statfs(2), on the real filesystem of tmp_path."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from shardio.errors import StorageError, UsageError
from shardio.storage.fsdetect import (
    FS_MAGIC,
    KNOWN_FS_TYPES,
    PARALLEL_FS,
    FsInfo,
    _mount_of,
    _name_from_mount,
    _unescape,
    describe_fs,
    detect_fs_type,
    resolve_fs_type,
    statfs_magic,
)
from shardio.storage.runner import run_command

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="statfs is Linux")


def test_magic_table_has_the_required_filesystems() -> None:
    expected = {
        0x0BD00BD0: "lustre",
        0x19830326: "beegfs",
        0x47504653: "gpfs",
        0x6969: "nfs",
        0x01021994: "tmpfs",
        0xEF53: "ext4",
        0x58465342: "xfs",
        0x9123683E: "btrfs",
        0x794C7630: "overlay",
        0x2FC12FC1: "zfs",
        0x00C36400: "cephfs",
        0x65735546: "fuse",
    }
    assert expected.items() <= FS_MAGIC.items()
    assert {"lustre", "beegfs", "gpfs"} == PARALLEL_FS
    assert set(FS_MAGIC.values()) | {"local"} <= KNOWN_FS_TYPES


@linux_only
def test_detects_a_known_filesystem_for_tmp_path(tmp_path: Path) -> None:
    assert detect_fs_type(tmp_path) in FS_MAGIC.values()


@linux_only
@pytest.mark.skipif(shutil.which("stat") is None, reason="needs coreutils stat")
def test_statfs_magic_agrees_with_coreutils_stat(tmp_path: Path) -> None:
    result = run_command(["stat", "-f", "-c", "%t", str(tmp_path)])
    assert result.ok, result.stderr
    assert statfs_magic(tmp_path) == int(result.stdout.strip(), 16)


@linux_only
def test_missing_path_walks_up_to_nearest_existing_parent(tmp_path: Path) -> None:
    missing = tmp_path / "not" / "yet" / "created"
    assert detect_fs_type(missing) == detect_fs_type(tmp_path)
    assert detect_fs_type(str(missing)) == detect_fs_type(tmp_path)
    assert not missing.exists()


@linux_only
def test_statfs_magic_on_missing_path_raises_storage_error_naming_it(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "absent"
    with pytest.raises(StorageError, match="absent") as info:
        statfs_magic(missing)
    assert isinstance(info.value, OSError)
    assert info.value.errno == 2


def test_override_is_validated_and_normalised(tmp_path: Path) -> None:
    assert resolve_fs_type(tmp_path, "lustre") == "lustre"
    assert resolve_fs_type(tmp_path, " BeeGFS ") == "beegfs"
    assert resolve_fs_type(tmp_path / "missing", "local") == "local"


def test_unknown_override_lists_allowed_names(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as info:
        resolve_fs_type(tmp_path, "lustr")
    message = str(info.value)
    assert "'lustr'" in message
    for name in ("auto", "lustre", "beegfs", "gpfs", "local", "ext4"):
        assert name in message
    assert "\n" not in message


@linux_only
@pytest.mark.parametrize("override", [None, "auto", "AUTO"])
def test_no_override_detects(tmp_path: Path, override: str | None) -> None:
    assert resolve_fs_type(tmp_path, override) == detect_fs_type(tmp_path)


# --------------------------------------------------------------------------- describe_fs
# Synthetic mount tables (the mountinfo format of proc(5)): the name comes from the mount's
# type and source where the statfs magic cannot tell (FUSE), or where statfs is not asked.


def _line(mid: int, point: str, fstype: str, source: str, *, optional: str = "shared:1") -> str:
    return f"{mid} 1 0:{mid} / {point} rw,relatime {optional} - {fstype} {source} rw"


BASE = [_line(20, "/", "ext4", "/dev/sda1"), _line(21, "/proc", "proc", "proc")]


def _table(*lines: str) -> str:
    return "\n".join([*BASE, *lines]) + "\n"


@pytest.mark.parametrize(
    ("fstype", "source", "name", "network"),
    [
        ("lustre", "10.0.0.1@o2ib:/scratch", "lustre", True),
        ("beegfs", "beegfs_nodev", "beegfs", True),
        ("gpfs", "gpfs0", "gpfs", True),
        ("nfs", "server:/export", "nfs", True),
        ("nfs4", "server:/export", "nfs", True),
        ("ceph", "10.0.0.1:6789:/", "cephfs", True),
        ("fuse.ceph-fuse", "ceph-fuse", "cephfs", True),
        ("fuse", "mfs#10.1.2.1:9421", "moosefs", True),
        ("fuse.mfs", "mfs#mfsmaster:9421", "moosefs", True),
        ("fuse.moosefs", "mfsmaster:9421", "moosefs", True),
        ("fuse.glusterfs", "srv:/vol", "glusterfs", True),
        ("fuse.sshfs", "user@host:/data", "fuse", True),
        ("fuseblk", "/dev/sdb1", "fuseblk", False),
        ("cifs", "//srv/share", "cifs", True),
        ("wekafs", "weka0", "weka", True),
    ],
)
def test_the_mount_table_names_what_the_magic_cannot(
    fstype: str, source: str, name: str, network: bool
) -> None:
    point, fs_type, src = _mount_of("/data/x/y", _table(_line(30, "/data", fstype, source)))
    assert (point, fs_type, src) == ("/data", fstype, source)
    got = _name_from_mount(fs_type, src, "fuse")
    assert got == name
    info = FsInfo(name=got, magic=0x65735546, mount_point=point, mount_type=fs_type, source=src)
    assert info.network is network
    assert info.parallel is (name in {"lustre", "beegfs", "gpfs"})


@pytest.mark.parametrize(
    ("fstype", "magic_name"), [("ext4", "ext4"), ("xfs", "xfs"), ("tmpfs", "tmpfs")]
)
def test_a_local_filesystem_keeps_its_magic_name(fstype: str, magic_name: str) -> None:
    assert _name_from_mount(fstype, "/dev/nvme0n1p1", magic_name) == magic_name
    info = FsInfo(name=magic_name, magic=0xEF53, mount_type=fstype)
    assert not info.network
    assert not info.parallel


def test_without_statfs_the_table_alone_names_the_filesystem() -> None:
    # magic 0 or unknown (statfs could not be asked): the table's type is the name.
    for fstype, name in [("xfs", "xfs"), ("ext4", "ext4"), ("ext3", "ext4"), ("tmpfs", "tmpfs")]:
        assert _name_from_mount(fstype, "/dev/x", "unknown") == name
    assert _name_from_mount("lustre", "a@tcp:/fs", "unknown") == "lustre"
    assert _name_from_mount("fuse.whatever", "x", "unknown") == "fuse"
    assert _name_from_mount("weird", "x", "unknown") == "unknown"


def test_escaped_spaces_and_backslashes_in_mount_points_and_sources() -> None:
    table = _table(_line(30, r"/mnt/my\040data", "fuse", r"mfs#10.0.0.1:9421"))
    assert _mount_of("/mnt/my data/ds", table)[:2] == ("/mnt/my data", "fuse")
    assert _mount_of("/mnt/my\\040data/ds", table)[0] == "/"  # the escape is not the name
    assert _unescape(r"a\040b\011c\134d") == "a b\tc\\d"
    # Not three octal digits: left as written (int(..., 8) would refuse "\089" and "\٣٣٣").
    for raw in (r"x\089", "x\\\u0663\u0663\u0663", "x\\04", "x\\", r"x\4", "\\"):
        assert _unescape(raw) == raw


def test_the_longest_containing_mount_wins_and_prefixes_are_whole_components() -> None:
    table = _table(
        _line(30, "/data", "nfs4", "srv:/d"),
        _line(31, "/data/mfs", "fuse", "mfs#10.0.0.1:9421"),
        _line(32, "/data/mfs2", "lustre", "x@tcp:/fs"),
    )
    assert _mount_of("/data/mfs/ds", table)[1] == "fuse"
    assert _mount_of("/data/mfs", table)[1] == "fuse"
    assert _mount_of("/data/mfs2/ds", table)[1] == "lustre"
    assert _mount_of("/data/mfsx", table)[1] == "nfs4"  # /data/mfs is no prefix of mfsx
    assert _mount_of("/elsewhere", table)[0] == "/"


def test_stacked_mounts_the_one_on_top_wins() -> None:
    # Two mounts on one point: the later is on top.
    table = _table(
        _line(30, "/scratch", "nfs4", "srv:/d"), _line(31, "/scratch", "lustre", "m@tcp:/s")
    )
    assert _mount_of("/scratch/ds", table)[1] == "lustre"
    # A mount over a parent hides the deeper mount made before it.
    table = _table(
        _line(30, "/a/b", "fuse", "mfs#10.0.0.1:9421"), _line(31, "/a", "xfs", "/dev/sdb")
    )
    assert _mount_of("/a/b/ds", table)[:2] == ("/a", "xfs")
    # ... but not one made after it.
    table = _table(
        _line(30, "/a", "xfs", "/dev/sdb"), _line(31, "/a/b", "fuse", "mfs#10.0.0.1:9421")
    )
    assert _mount_of("/a/b/ds", table)[:2] == ("/a/b", "fuse")


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "garbage",
        "1 2 3",
        "30 1 0:30 / /data rw - ",  # no type or source after the separator
        "30 1 0:30 / /data rw - fuse",  # no source
        "30 1 0:30 / /data rw fuse mfs#x:1 rw",  # no separator
        " - fuse mfs#1.2.3.4:9421 rw",  # nothing before the separator
        "30 1 0:30 / relative rw - fuse mfs#1.2.3.4:9421 rw",  # not an absolute mount point
        "\x00\xff\ufffd - - - - -",
        "30 1 0:30 / /data rw - fuse mfs#1.2.3.4:9421 rw extra fields are fine",
    ],
)
def test_garbage_lines_are_ignored(garbage: str) -> None:
    point, fstype, _ = _mount_of("/data/ds", _table(garbage))
    if garbage.startswith("30 1 0:30 / /data rw - fuse mfs#"):
        assert (point, fstype) == ("/data", "fuse")
    else:
        assert (point, fstype) == ("/", "ext4")


def test_an_empty_or_absent_table_is_no_error(tmp_path: Path) -> None:
    assert _mount_of("/data", "") == ("", "", "")
    info = describe_fs(tmp_path, mountinfo="")
    assert info.mount_point == ""
    assert info.name == detect_fs_type(tmp_path)


def test_a_huge_table_is_read_in_one_pass() -> None:
    # A node with many thousands of mounts (containers, automounts): linear, no blow-up.
    lines = [_line(100 + i, f"/var/lib/c/{i}/rootfs", "overlay", "overlay") for i in range(50_000)]
    table = _table(*lines, _line(9, "/mfs", "fuse", "mfs#10.0.0.1:9421"))
    assert _mount_of("/mfs/ds/shards", table) == ("/mfs", "fuse", "mfs#10.0.0.1:9421")
    assert _mount_of("/var/lib/c/4242/rootfs/x", table)[0] == "/var/lib/c/4242/rootfs"


@linux_only
def test_describe_fs_of_a_local_path(tmp_path: Path) -> None:
    info = describe_fs(tmp_path)
    assert info.name == detect_fs_type(tmp_path)
    assert info.magic == statfs_magic(tmp_path)
    assert info.mount_point and str(tmp_path.resolve()).startswith(info.mount_point)
    assert info.name in info.describe()
    if info.name in {"ext4", "xfs", "tmpfs", "btrfs", "overlay", "zfs"}:
        assert not info.network
    # A path that does not exist yet is described by its nearest existing parent.
    assert describe_fs(tmp_path / "not" / "yet") == info


@linux_only
def test_describe_fs_of_a_fuse_path_reads_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardio.storage.fsdetect as fsdetect

    monkeypatch.setattr(fsdetect, "statfs_magic", lambda _path: 0x65735546)
    table = _table(_line(30, "/", "fuse", "mfs#10.9.8.1:9421"))
    info = describe_fs("/", mountinfo=table)
    assert (info.name, info.network, info.mount_type) == ("moosefs", True, "fuse")
    assert info.describe() == "moosefs (fuse, mfs#10.9.8.1:9421 at /)"
    table = _table(_line(30, "/", "fuse.sshfs", "u@h:/"))
    assert describe_fs("/", mountinfo=table).name == "fuse"
    table = _table(_line(30, "/", "fuseblk", "/dev/sdb1"))
    assert not describe_fs("/", mountinfo=table).network


@linux_only
def test_describe_fs_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardio.storage.fsdetect as fsdetect

    def broken(path: object) -> int:
        raise StorageError("statfs failed")

    monkeypatch.setattr(fsdetect, "statfs_magic", broken)
    info = describe_fs("/", mountinfo=_table())
    assert (info.name, info.magic, info.mount_type) == ("ext4", 0, "ext4")  # from the table
    info = describe_fs("/", mountinfo="")
    assert (info.name, info.network) == ("unknown", False)
    assert info.describe() == "unknown (magic 0x00000000)"
