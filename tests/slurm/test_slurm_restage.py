"""A node lost: a job staged for 2 nodes restarts on the other one, under real srun. The
shares are dealt by host name (SLURM_JOB_NODELIST, expanded by shardio, checked against
SLURM_NODEID and SLURMD_NODENAME), and the training ranks compute the same share as the
stager. node1, the FIRST node, is lost: the survivor node2 (renumbered 0) keeps its copies
(not one re-copied) and takes node1's share from node1's area (``--peers``), not from the
source; then the job grows back to 2 nodes the same way."""

from __future__ import annotations

import json
import pathlib
import re
import sys

from slurmbed import Cluster

SHARDIO = pathlib.Path(sys.executable).parent / "shardio"
ORDER = "order=random,seed=1,partition=node"
_MOVED = re.compile(r"node (\d)/(\d): kept (\S+ \S+), from peers (\S+ \S+), from source (\S+ \S+)")
# What a training rank reads, by the rank layout it detects: its node's name and shards.
_TRAIN = (
    "import json, numpy as np; from shardio.order import OrderSpec, detect_ranks, node_shares; "
    "from shardio.format.identity import load_identified; import sys; "
    "m = load_identified(sys.argv[1])[0]; r = detect_ranks(); "
    "o = node_shares([s.num_samples for s in m.shards], OrderSpec.parse(sys.argv[2]), 0, "
    "r.num_nodes, r.node_keys); "
    "print(json.dumps([r.node_key, list(r.node_keys), "
    "sorted(m.shards[i].path for i in np.flatnonzero(o == r.node))]))"
)


def _stage(cluster: Cluster, dataset: pathlib.Path, root: pathlib.Path, hosts: list[str]) -> dict:
    """Stage ``dataset`` on ``hosts`` as one srun step, each node into
    ``root/<node name>``, the other nodes' areas as peers; host -> (kept, peers, source)."""
    script = (
        f'exec {SHARDIO} stage {dataset} {root}/"$SLURMD_NODENAME" --node auto --order {ORDER} '
        f"--peers '{root}/node*' --no-progress"
    )
    n = str(len(hosts))
    proc = cluster.srun(
        "-N", n, "-n", n, "--ntasks-per-node=1", "-w", ",".join(hosts), "bash", "-c", script,
        cwd=root, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    found = {hosts[int(m[1])]: m.groups()[2:] for m in _MOVED.finditer(proc.stdout)}
    assert sorted(found) == sorted(hosts), proc.stdout
    for host in hosts:
        plan = _plan(root / host)
        assert plan["staged_for"]["node_keys"] == hosts
        assert plan["staged_for"]["node_key"] == host
    return found


def _plan(area: pathlib.Path) -> dict:
    return json.loads((area / ".shardio-stage" / "plan.json").read_text())


def _files(area: pathlib.Path) -> dict[str, int]:
    """Staged shard -> inode (a kept copy keeps its inode; a re-copied one gets a new one)."""
    return {p.name: p.stat().st_ino for p in (area / "shards").glob("*.tar")}


def test_training_ranks_read_the_share_the_stager_staged(
    slurm_cluster2: Cluster, slurm_dataset: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    _stage(slurm_cluster2, slurm_dataset, tmp_path, ["node1", "node2"])
    proc = slurm_cluster2.srun(
        "-N", "2", "-n", "2", "--ntasks-per-node=1", sys.executable, "-c", _TRAIN,
        str(slurm_dataset), ORDER, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    seen = {key: (keys, shards) for key, keys, shards in lines}
    assert sorted(seen) == ["node1", "node2"]
    for host, (keys, shards) in seen.items():
        assert keys == ["node1", "node2"]
        assert shards == sorted(_plan(tmp_path / host)["shards"])


def test_a_survivor_keeps_its_copies_and_takes_the_lost_share_from_its_peer(
    slurm_cluster2: Cluster, slurm_dataset: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    first = _stage(slurm_cluster2, slurm_dataset, tmp_path, ["node1", "node2"])
    assert all(kept == "0 B" and peers == "0 B" for kept, peers, _ in first.values())
    before = {n: _files(tmp_path / n) for n in ("node1", "node2")}
    assert before["node1"] and before["node2"] and not before["node1"].keys() & before["node2"]
    # node1, the first node, is lost: the job restarts on node2 alone (now node 0), node1's
    # area still readable
    (kept, peers, source) = _stage(slurm_cluster2, slurm_dataset, tmp_path, ["node2"])["node2"]
    assert source == "0 B" and kept != "0 B" and peers != "0 B"
    after = _files(tmp_path / "node2")
    assert {k: after[k] for k in before["node2"]} == before["node2"]  # every copy kept
    assert after.keys() == before["node1"].keys() | before["node2"].keys()
    # back to 2 nodes: a fresh node1 takes its share from node2's area, node2 keeps all
    (tmp_path / "node1").rename(tmp_path / "gone")
    again = _stage(slurm_cluster2, slurm_dataset, tmp_path, ["node1", "node2"])
    assert again["node2"][1:] == ("0 B", "0 B") and again["node1"][2] == "0 B"
    assert _files(tmp_path / "node1").keys() == before["node1"].keys()
    assert _files(tmp_path / "node2") == after
