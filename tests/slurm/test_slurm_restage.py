"""A node lost: a job staged for 2 nodes restarts on 1, under real srun. The survivor keeps
its copies (not one re-copied) and takes the lost node's share from that node's area
(``--peers``), not from the source; then the job grows back to 2 nodes the same way."""

from __future__ import annotations

import pathlib
import re
import sys

from slurmbed import Cluster

SHARDIO = pathlib.Path(sys.executable).parent / "shardio"
ORDER = "order=random,seed=1,partition=node"
_MOVED = re.compile(r"node (\d)/(\d): kept (\S+ \S+), from peers (\S+ \S+), from source (\S+ \S+)")


def _stage(cluster: Cluster, dataset: pathlib.Path, root: pathlib.Path, nodes: int) -> dict:
    """Stage ``dataset`` for ``nodes`` nodes as one srun step, each node into
    ``root/<node name>``, the other nodes' areas as peers; node -> (kept, peers, source)."""
    script = (
        f'exec {SHARDIO} stage {dataset} {root}/"$SLURMD_NODENAME" --node auto --order {ORDER} '
        f"--peers '{root}/node*' --no-progress"
    )
    proc = cluster.srun(
        "-N", str(nodes), "-n", str(nodes), "--ntasks-per-node=1", "bash", "-c", script,
        cwd=root, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    found = {int(m[1]): m.groups()[2:] for m in _MOVED.finditer(proc.stdout)}
    assert sorted(found) == list(range(nodes)), proc.stdout
    return found


def _files(area: pathlib.Path) -> dict[str, int]:
    """Staged shard -> inode (a kept copy keeps its inode; a re-copied one gets a new one)."""
    return {p.name: p.stat().st_ino for p in (area / "shards").glob("*.tar")}


def test_a_survivor_keeps_its_copies_and_takes_the_lost_share_from_its_peer(
    slurm_cluster2: Cluster, slurm_dataset: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    first = _stage(slurm_cluster2, slurm_dataset, tmp_path, 2)
    assert all(kept == "0 B" and peers == "0 B" for kept, peers, _ in first.values())
    before = {n: _files(tmp_path / n) for n in ("node1", "node2")}
    assert before["node1"] and before["node2"] and not before["node1"].keys() & before["node2"]
    # node2 is lost: the job restarts on node1 alone, node2's area still readable
    ((kept, peers, source),) = _stage(slurm_cluster2, slurm_dataset, tmp_path, 1).values()
    assert source == "0 B" and kept != "0 B" and peers != "0 B"
    after = _files(tmp_path / "node1")
    assert {k: after[k] for k in before["node1"]} == before["node1"]  # every copy kept
    assert after.keys() == before["node1"].keys() | before["node2"].keys()
    # back to 2 nodes: a fresh node2 takes its share from node1's area, node1 keeps all
    (tmp_path / "node2").rename(tmp_path / "gone")
    again = _stage(slurm_cluster2, slurm_dataset, tmp_path, 2)
    assert again[0][1:] == ("0 B", "0 B") and again[1][2] == "0 B"
    assert _files(tmp_path / "node2").keys() == before["node2"].keys()
    assert _files(tmp_path / "node1") == after
