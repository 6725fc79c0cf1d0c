"""The shipped scripts/slurm/train_8gpu.sbatch, submitted with real sbatch to this cluster.

It is scaled to this machine by sbatch options, which take precedence over its #SBATCH lines:
2 tasks of 1 CPU on the one node, no GPUs (--gres=none). The job stages the dataset on the
node (its prologue), trains with bind.sh under srun --cpu-bind=cores through retry_srun.sh,
and removes the staged copy in its epilogue. The "training" is a tiny python that reads the
staged dataset through shardio's loader and records what it saw.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import time

import pytest
from fakesysfs import fake_sysfs
from slurmbed import Cluster

from shardio.topology import format_cpulist

REPO = pathlib.Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts" / "slurm" / "train_8gpu.sbatch"
ORDER = "order=random,seed=1"

TRAIN = """\
import hashlib, json, os, pathlib, sys, time
from shardio import ShardDataset

rank = os.environ["RANK"]
out = pathlib.Path(sys.argv[1])
tries = out / f"tries-{rank}"
tries.write_text(tries.read_text() + "x" if tries.exists() else "x")
if rank == "0" and len(tries.read_text()) == 1 and sys.argv[2] == "fail-once":
    sys.exit(1)  # the first try fails: retry_srun.sh stages again and retries
if sys.argv[2] == "fail-always":
    sys.exit(3)
if sys.argv[2] == "wait":  # until the job is signalled (bounded: the test fails after 60 s)
    (out / f"started-{rank}").write_text("")
    time.sleep(60)
    sys.exit(0)
stage = pathlib.Path(os.environ["SHARDIO_STAGE_DIR"])
ds = ShardDataset(os.environ["SHARDIO_DATA"], stage=stage, order=os.environ["SHARDIO_ORDER"])
samples = {}
for batch in ds.loader(batch_size=4, num_workers=1):
    for key, payload in zip(batch["__key__"], batch["bin"]):
        samples[key] = hashlib.sha256(payload).hexdigest()
record = {
    "samples": samples,
    "staged": sorted(p.name for p in (stage / "shards").glob("*.tar")),
    "cpus": sorted(os.sched_getaffinity(0)),
    "env": {k: os.environ.get(k) for k in (
        "WORLD_SIZE", "LOCAL_RANK", "SHARDIO_BOUND_CPUS", "OMP_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES", "SLURM_CPU_BIND", "SHARDIO_STAGE_DIR")},
}
(out / f"rank{rank}.json").write_text(json.dumps(record))
"""


@pytest.fixture
def job_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "job"
    path.mkdir()
    (path / "train.py").write_text(TRAIN)
    return path


def submit(
    cluster: Cluster,
    job_dir: pathlib.Path,
    dataset: pathlib.Path,
    mode: str,
    ntasks: int = 2,
    **env: str,
) -> tuple[str, pathlib.Path, pathlib.Path]:
    """Submit the job script scaled to this node, ``ntasks`` tasks of one CPU; (job id, its
    output file, the staging base)."""
    nvme = job_dir / "nvme"
    nvme.mkdir()
    output = job_dir / "job.out"
    sysfs = fake_sysfs(job_dir / "sys", {0: format_cpulist(os.sched_getaffinity(0))}, [0, 0])
    job_id = cluster.sbatch(
        "--nodes=1", f"--ntasks-per-node={ntasks}", "--cpus-per-task=1", "--gres=none",
        # More than the 5 minutes of the script's --signal=B:USR1@300: with less, Slurm sends
        # USR1 at once and the job stops training as if its time limit were near.
        "--time=30", f"--output={output}", f"--chdir={job_dir}", SBATCH,
        env={
            "SHARDIO_HOME": str(REPO),
            "SHARDIO_DATA": str(dataset),
            "SHARDIO_ORDER": ORDER,
            "SHARDIO_STAGE_ARGS": f"--order {ORDER}",
            "TRAIN_CMD": f"python {job_dir / 'train.py'} {job_dir} {mode}",
            "TMPDIR": str(nvme),  # where `shardio stage` puts the job's area
            "SHARDIO_SYSFS": sysfs,  # two GPUs on one NUMA node, for bind.sh's `shardio topo`
            "RETRY_SRUN_BACKOFF_S": "0",
            **env,
        },
        cwd=job_dir,
    )  # fmt: skip
    return job_id, output, nvme


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two tasks of one CPU each")
def test_the_job_stages_binds_retries_trains_and_cleans(
    slurm_cluster: Cluster,
    slurm_dataset: pathlib.Path,
    slurm_tree: pathlib.Path,
    job_dir: pathlib.Path,
) -> None:
    job_id, output, nvme = submit(slurm_cluster, job_dir, slurm_dataset, "fail-once")
    job = slurm_cluster.wait_job(job_id, timeout_s=120)
    log = output.read_text() if output.exists() else "(no output file)"
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), log
    shards = len(list(slurm_dataset.glob("shards/*.tar")))
    area = nvme / f"shardio-0-{job_id}"
    assert f"staged node 0/1: {shards} of {shards} shards" in log
    assert f"at {area}/" in log
    # Rank 0 exits 1; srun reports 143 instead when --kill-on-bad-exit=1 ended rank 1 (SIGTERM)
    # before that finished by itself.
    assert re.search(r"try 1/3 failed with exit (1|143)\n", log), log
    assert "before try 2: srun" in log  # the restage hook
    assert "try 2/3 succeeded" in log
    assert f"removed {shards} staged shard(s)" in log
    assert "job ends with exit 0" in log

    ranks = [json.loads((job_dir / f"rank{r}.json").read_text()) for r in range(2)]
    source = {
        f.relative_to(slurm_tree).with_suffix("").as_posix(): hashlib.sha256(
            f.read_bytes()
        ).hexdigest()
        for f in slurm_tree.rglob("*.bin")
    }
    assert not set(ranks[0]["samples"]) & set(ranks[1]["samples"])
    assert ranks[0]["samples"] | ranks[1]["samples"] == source
    for r, rank in enumerate(ranks):
        env = rank["env"]
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == str(r)
        assert env["CUDA_VISIBLE_DEVICES"] == str(r)  # bind.sh's GPU of the local rank
        assert env["SLURM_CPU_BIND"].startswith("quiet,mask_cpu:")  # --cpu-bind=cores
        assert rank["cpus"] == [int(env["SHARDIO_BOUND_CPUS"])]
        assert env["OMP_NUM_THREADS"] == "1"
        assert env["SHARDIO_STAGE_DIR"].startswith(f"{area}/")
        assert len(rank["staged"]) == shards  # the whole set was on the node while training
    assert ranks[0]["cpus"] != ranks[1]["cpus"]
    assert list(nvme.iterdir()) == []  # the epilogue removed the area and its directory


def test_a_job_whose_training_keeps_failing_ends_failed_and_still_cleans(
    slurm_cluster: Cluster, slurm_dataset: pathlib.Path, job_dir: pathlib.Path
) -> None:
    # One task: with two, srun --kill-on-bad-exit=1 may end the second with SIGTERM before
    # it exits by itself, and srun then reports 143, not 3.
    job_id, output, nvme = submit(
        slurm_cluster, job_dir, slurm_dataset, "fail-always", ntasks=1, SHARDIO_TRIES="2"
    )
    job = slurm_cluster.wait_job(job_id, timeout_s=120)
    log = output.read_text() if output.exists() else "(no output file)"
    assert (job.state, job.exit_code) == ("FAILED", "3:0"), log
    assert "task 0: Exited with exit code 3" in log
    assert "try 1/2 failed with exit 3" in log
    assert "giving up after 2 tries; exit 3" in log
    assert "job ends with exit 3" in log
    assert (job_dir / "tries-0").read_text() == "xx"  # two tries of the training step
    assert list(nvme.iterdir()) == []


def test_usr1_to_the_batch_shell_stops_training_and_still_cleans(
    slurm_cluster: Cluster, slurm_dataset: pathlib.Path, job_dir: pathlib.Path
) -> None:
    # What --signal=B:USR1@300 sends 5 minutes before the time limit, sent now by scancel.
    job_id, output, nvme = submit(slurm_cluster, job_dir, slurm_dataset, "wait")
    end = time.monotonic() + 60
    while not all((job_dir / f"started-{r}").exists() for r in range(2)):
        assert time.monotonic() < end, "the training step did not start within 60 s"
        assert slurm_cluster.job(job_id).state in {"PENDING", "RUNNING", "CONFIGURING"}
        time.sleep(0.3)
    proc = slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job_id], timeout=30)
    assert proc.returncode == 0, proc.stderr
    job = slurm_cluster.wait_job(job_id, timeout_s=60)
    log = output.read_text() if output.exists() else "(no output file)"
    assert "got SIGUSR1: stopping training" in log
    match = re.search(r"stopped by SIGTERM after try 1; exit (\d+)\n", log)
    assert match, log
    rc = match.group(1)
    assert rc != "0"
    assert "try 2/3" not in log  # no retry once the job is ending
    assert f"job ends with exit {rc}" in log
    assert (job.state, job.exit_code) == ("FAILED", f"{rc}:0"), log
    assert not (job_dir / "rank0.json").exists()  # training did not finish
    assert list(nvme.iterdir()) == []  # the epilogue still cleaned the node
