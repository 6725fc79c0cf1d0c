"""Multi-task packing and per-node staging as job steps of real srun.

``shardio pack --part auto`` and ``shardio stage --node auto`` take their part and node from
the SLURM_PROCID/SLURM_NTASKS and SLURM_NODEID/SLURM_NNODES that srun gives each task.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from slurmbed import Cluster

SHARDIO = pathlib.Path(sys.executable).parent / "shardio"


def unpacked(dataset: pathlib.Path, out: pathlib.Path) -> dict[str, bytes]:
    """Every member of ``dataset`` (``shardio unpack``): relative path -> bytes."""
    proc = subprocess.run(
        [SHARDIO, "unpack", "--no-progress", dataset, out],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return {f.relative_to(out).as_posix(): f.read_bytes() for f in out.rglob("*") if f.is_file()}


def test_pack_as_two_tasks_then_merge_equals_a_single_part_pack(
    slurm_cluster: Cluster,
    slurm_tree: pathlib.Path,
    slurm_dataset: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    dst = tmp_path / "ds"
    proc = slurm_cluster.srun(
        "-n", "2", SHARDIO, "pack", slurm_tree, dst, "--part", "auto",
        "--shard-size", "8KiB", "--workers", "1", "--no-progress",
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # Each task packed its own part; nothing is a dataset before the merge.
    assert "at part 0/2 of" in proc.stdout and "at part 1/2 of" in proc.stdout
    assert not (dst / "manifest.json").exists()
    parts = sorted(p.name for p in (dst / ".shardio-work").glob("part-*.json"))
    assert parts == ["part-0000-of-0002.json", "part-0001-of-0002.json"]

    merge = slurm_cluster.srun("-n", "1", SHARDIO, "merge", "--no-progress", dst, cwd=tmp_path)
    assert merge.returncode == 0, merge.stderr
    assert "merged 2 parts" in merge.stdout
    verify = slurm_cluster.srun("-n", "1", SHARDIO, "verify", "--no-progress", dst, cwd=tmp_path)
    assert verify.returncode == 0, verify.stderr + verify.stdout
    assert verify.stdout.startswith("OK: verified")

    merged = json.loads((dst / "manifest.json").read_text())
    single = json.loads((slurm_dataset / "manifest.json").read_text())
    assert merged["num_samples"] == single["num_samples"] == 24
    got = unpacked(dst, tmp_path / "merged")
    assert got == unpacked(slurm_dataset, tmp_path / "single")
    source = {
        f.relative_to(slurm_tree).as_posix(): f.read_bytes() for f in slurm_tree.rglob("*.bin")
    }
    assert {k: v for k, v in got.items() if k.endswith(".bin")} == source


def shard_names(dataset: pathlib.Path) -> set[str]:
    """The shard files of a dataset's manifest (what a full staging copies)."""
    manifest = json.loads((dataset / "manifest.json").read_text())
    return {pathlib.PurePosixPath(s["path"]).name for s in manifest["shards"]}


def staged(area: pathlib.Path) -> set[str]:
    """The shard files staged in ``area`` (the DALI .idx files beside them left out)."""
    shards = area / "shards"
    return {p.name for p in shards.glob("*.tar")} if shards.is_dir() else set()


def test_stage_node_auto_on_one_node_stages_the_whole_set(
    slurm_cluster: Cluster, slurm_dataset: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    area = tmp_path / "nvme" / "ds"
    proc = slurm_cluster.srun(
        "-N", "1", "-n", "1", SHARDIO, "stage", slurm_dataset, area, "--node", "auto",
        "--order", "order=random,seed=1,partition=node", "--no-progress",
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "staged node 0/1" in proc.stdout
    assert staged(area) == shard_names(slurm_dataset)
    verify = subprocess.run(
        [SHARDIO, "verify", "--no-progress", area], capture_output=True, text=True, check=False
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_stage_node_auto_on_two_nodes_splits_a_node_partition(
    slurm_cluster2: Cluster, slurm_dataset: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    # Both slurmd run on this host: each node stages into an area named after it.
    script = (
        f'exec {SHARDIO} stage {slurm_dataset} {tmp_path}/"$SLURMD_NODENAME"/ds --node auto '
        "--order order=random,seed=1,partition=node --no-progress"
    )
    proc = slurm_cluster2.srun(
        "-N", "2", "-n", "2", "--ntasks-per-node=1", "bash", "-c", script,
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "staged node 0/2" in proc.stdout and "staged node 1/2" in proc.stdout
    shares = [staged(tmp_path / node / "ds") for node in ("node1", "node2")]
    assert all(shares), shares  # each node has a share of its own
    assert not shares[0] & shares[1]
    assert shares[0] | shares[1] == shard_names(slurm_dataset)
