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
