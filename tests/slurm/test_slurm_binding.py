"""CPU binding of co-located ranks under real srun: the tasks, their threads, their workers.

Each task runs tests/slurm/affinity_probe.py: it reads the packed dataset through
``ShardDataset(...).loader(num_workers=2)`` and records the CPUs the kernel lets it, each of
its threads and each DataLoader worker (and the worker's threads) run on. srun's task/affinity
plugin sets the masks; bind.sh and shardio's worker pinning split an unbound node by the GPU
map of a fake sysfs tree (no GPU here), like the one tests/scripts/test_bind_topo.py uses.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from typing import Any

import pytest
from fakesysfs import fake_sysfs
from slurmbed import Cluster

from shardio.topology import format_cpulist, parse_cpulist

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROBE = HERE / "affinity_probe.py"
BIND = REPO / "scripts" / "slurm" / "bind.sh"
ALLOWED = frozenset(os.sched_getaffinity(0))

pytestmark = pytest.mark.skipif(len(ALLOWED) < 2, reason="two co-located ranks need two CPUs")


class Rank:
    """What the probe recorded for one task."""

    def __init__(self, record: dict[str, Any], workers: list[dict[str, Any]]) -> None:
        self.record = record
        self.workers = workers

    @property
    def cpus(self) -> frozenset[int]:
        """The task's CPUs; its two views (sched_getaffinity, /proc) must agree."""
        sched = frozenset(self.record["sched"])
        assert sched == parse_cpulist(self.record["status"]), self.record
        return sched

    @property
    def thread_cpus(self) -> list[frozenset[int]]:
        return [parse_cpulist(c) for c in self.record["threads"].values()]

    def worker_cpus(self) -> list[frozenset[int]]:
        """Each worker's CPUs, checked equal to each of its threads' (one started there)."""
        found = []
        for worker in self.workers:
            cpus = frozenset(worker["sched"])
            assert cpus == parse_cpulist(worker["status"]), worker
            assert len(worker["threads"]) >= 2, worker  # the worker and the thread it started
            for tid, listed in worker["threads"].items():
                assert parse_cpulist(listed) == cpus, (tid, listed, worker)
            found.append(cpus)
        return found

    def all_cpus(self) -> frozenset[int]:
        """Every CPU any process or thread of this rank may run on."""
        return self.cpus.union(*self.thread_cpus, *self.worker_cpus())


def run_probe(
    cluster: Cluster,
    dataset: pathlib.Path,
    out: pathlib.Path,
    srun_opts: list[str],
    *,
    bind: bool = False,
    env: dict[str, str] | None = None,
) -> list[Rank]:
    out.mkdir()
    cmd = [sys.executable, str(PROBE), str(dataset), str(out)]
    proc = cluster.srun(
        "-n", "2", *srun_opts, *([str(BIND)] if bind else []), *cmd,
        env=env, cwd=out, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ranks = []
    for r in range(2):
        record = json.loads((out / f"rank{r}.json").read_text())
        workers = [json.loads(p.read_text()) for p in sorted(out.glob(f"rank{r}-worker*.json"))]
        assert len(workers) == 2, sorted(p.name for p in out.iterdir())
        ranks.append(Rank(record, workers))
    return ranks


def assert_every_sample_read_once(ranks: list[Rank], tree: pathlib.Path) -> None:
    """The two ranks (SLURM_PROCID 0, 1 of SLURM_NTASKS 2) read the source tree's samples
    in two disjoint halves."""
    keys = [r.record["keys"] for r in ranks]
    source = {f.relative_to(tree).with_suffix("").as_posix() for f in tree.rglob("*.bin")}
    assert len(keys[0]) == len(keys[1]) == len(source) // 2
    assert set(keys[0]) | set(keys[1]) == source


def srun_masks(cpu_bind: str) -> list[frozenset[int]]:
    """The per-task CPU sets of ``SLURM_CPU_BIND=quiet,mask_cpu:0x1,0x2``."""
    masks = cpu_bind.split("mask_cpu:", 1)[1].split(",")
    return [frozenset(i for i in range(64) if int(m, 16) >> i & 1) for m in masks]


@pytest.mark.parametrize("srun_opts", [["--cpu-bind=cores"], []], ids=["cores", "default"])
def test_srun_gives_each_co_located_rank_its_own_core_and_workers_inherit_it(
    slurm_cluster: Cluster,
    slurm_dataset: pathlib.Path,
    slurm_tree: pathlib.Path,
    tmp_path: pathlib.Path,
    srun_opts: list[str],
) -> None:
    # Without --cpu-bind, task/affinity binds tasks to cores by default as well.
    ranks = run_probe(slurm_cluster, slurm_dataset, tmp_path / "out", srun_opts)
    masks = srun_masks(ranks[0].record["cpu_bind"])
    for r, rank in enumerate(ranks):
        assert rank.cpus == masks[r] and len(rank.cpus) == 1, (r, rank.record)
        assert rank.all_cpus() == rank.cpus  # threads and workers stay on the rank's core
    assert not ranks[0].all_cpus() & ranks[1].all_cpus()
    assert_every_sample_read_once(ranks, slurm_tree)


def test_cpu_bind_none_leaves_co_located_ranks_on_shared_cpus(
    slurm_cluster: Cluster, slurm_dataset: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    # No GPU in /sys: shardio pins nothing, so without bind.sh both ranks share the node.
    ranks = run_probe(slurm_cluster, slurm_dataset, tmp_path / "out", ["--cpu-bind=none"])
    for rank in ranks:
        assert rank.record["cpu_bind"] == "quiet,none"
        assert rank.all_cpus() == rank.cpus == ALLOWED


@pytest.fixture
def two_gpus_one_node(tmp_path: pathlib.Path) -> dict[str, str]:
    """A fake sysfs: two GPUs on one NUMA node that holds this machine's CPUs."""
    sysfs = fake_sysfs(tmp_path / "sys", {0: format_cpulist(ALLOWED)}, [0, 0])
    return {"SHARDIO_SYSFS": sysfs}


def test_under_cpu_bind_none_bind_sh_splits_the_node_and_the_workers_stay_inside(
    slurm_cluster: Cluster,
    slurm_dataset: pathlib.Path,
    slurm_tree: pathlib.Path,
    tmp_path: pathlib.Path,
    two_gpus_one_node: dict[str, str],
) -> None:
    ranks = run_probe(
        slurm_cluster, slurm_dataset, tmp_path / "out", ["--cpu-bind=none"], bind=True,
        env=two_gpus_one_node,
    )  # fmt: skip
    for rank in ranks:
        assert rank.record["cpu_bind"] == "quiet,none"  # srun bound nothing
        assert rank.cpus == parse_cpulist(rank.record["bound_cpus"])  # bind.sh's share
        assert rank.cpus < ALLOWED
        assert rank.all_cpus() == rank.cpus
    assert not ranks[0].all_cpus() & ranks[1].all_cpus()
    assert ranks[0].cpus | ranks[1].cpus == ALLOWED
    assert_every_sample_read_once(ranks, slurm_tree)


def test_under_cpu_bind_none_shardio_pins_each_rank_s_workers_apart(
    slurm_cluster: Cluster,
    slurm_dataset: pathlib.Path,
    tmp_path: pathlib.Path,
    two_gpus_one_node: dict[str, str],
) -> None:
    # No bind.sh: the ranks themselves share the node, but the loader pins each rank's
    # workers to the rank's own share of its GPU's node (shardio.runtime.placement).
    ranks = run_probe(
        slurm_cluster, slurm_dataset, tmp_path / "out", ["--cpu-bind=none"],
        env=two_gpus_one_node,
    )  # fmt: skip
    shares = []
    for rank in ranks:
        assert rank.cpus == ALLOWED
        workers = rank.worker_cpus()
        assert len(set(workers)) == 1 and workers[0] < ALLOWED, workers
        shares.append(workers[0])
    assert not shares[0] & shares[1]
