"""On the MooseFS bed: fsdetect names it, and ``shardio inspect`` / ``shardio bench`` show the
filesystem and the read strategy in use (pfs, chosen automatically)."""

from __future__ import annotations

import json
from typing import Any

from mfsbed import Bed, PfsDataset

from shardio.read.strategy import PFS
from shardio.storage.fsdetect import describe_fs, detect_fs_type, resolve_fs_type


def test_describe_fs_names_the_bed_moosefs(pfs_bed: Bed, pfs_dataset: PfsDataset) -> None:
    for path in (
        pfs_bed.mount,
        pfs_dataset.path,
        pfs_dataset.path / "shards",
        pfs_bed.mount / "no" / "such",
    ):
        info = describe_fs(path)
        assert info.name == "moosefs", info
        assert info.network
        assert not info.parallel  # no stripe layout for shardio to set on MooseFS
        assert info.mount_point == str(pfs_bed.mount)
        assert info.source == f"mfs#{pfs_bed.addr}:9421"
        assert info.mount_type.startswith("fuse")
        assert info.describe() == f"moosefs ({info.mount_type}, {info.source} at {pfs_bed.mount})"
    assert detect_fs_type(pfs_bed.mount) == "fuse"  # the magic number alone cannot tell
    assert resolve_fs_type(pfs_bed.mount, None) == "moosefs"  # what pack plans the layout for


def test_inspect_on_the_bed(pfs_bed: Bed, pfs_dataset: PfsDataset, run_cli: Any) -> None:
    result = run_cli("inspect", pfs_dataset.path)
    assert (result.rc, result.stderr) == (0, "")
    lines = {ln[:14]: ln[14:] for ln in result.stdout.splitlines()}
    assert lines["filesystem    "] == describe_fs(pfs_dataset.path).describe()
    assert lines["read strategy "] == (
        f"pfs (auto: moosefs is a network filesystem): {PFS.describe()}"
    )
    assert "              filesystem now: moosefs, no striping" in result.stdout

    result = run_cli("inspect", pfs_dataset.path, "--json")
    assert (result.rc, result.stderr) == (0, "")
    info = json.loads(result.stdout)
    assert info["filesystem"] == "moosefs"
    assert info["filesystem_detail"]["network"] is True
    assert info["filesystem_detail"]["mount_point"] == str(pfs_bed.mount)
    assert info["read_strategy"] == {
        "name": "pfs",
        "reason": "auto: moosefs is a network filesystem",
        "description": PFS.describe(),
    }


def test_bench_on_the_bed(pfs_dataset: PfsDataset, run_cli: Any) -> None:
    result = run_cli(
        "bench", pfs_dataset.path, "--json", "--compute-ms", "0", "--workers", "0",
        "--batch", "32", "--epochs", "1",
    )  # fmt: skip
    assert result.rc == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["settings"]["filesystem"] == describe_fs(pfs_dataset.path).describe()
    assert report["settings"]["read_strategy"] == (
        f"pfs (auto: moosefs is a network filesystem): {PFS.describe()}"
    )
    [run] = [r for r in report["runs"] if r["runner"] == "shardio"]
    assert run["samples"] == len(pfs_dataset.payload)
