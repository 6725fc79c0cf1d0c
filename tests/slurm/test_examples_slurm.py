"""examples/slurm.sh, run as a user runs it, on the real one-host SLURM cluster.

Scaled to this machine by its variables (2 tasks of 1 CPU, no GPUs, a few steps of 8): it
submits scripts/slurm/train_8gpu.sbatch with examples/train.py, which stages the dataset to
the node's local disk, trains both ranks under torch.distributed (gloo), checkpoints into
SHARDIO_CKPT_DIR and cleans the staged copy up. (tests/slurm/test_readme_path.py submits
examples/train.py twice through the same template: the second job resumes.)
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from slurmbed import Cluster

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two tasks of one CPU each")
def test_slurm_sh_submits_train_py(slurm_cluster: Cluster, tmp_path: pathlib.Path) -> None:
    tree = tmp_path / "imagenet"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_imagenet.py"), str(tree), "--files", "64",
         "--classes", "4", "--mean-kb", "2", "--quiet"],
        check=True, timeout=120,
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "shardio", "pack", str(tree), str(tmp_path / "ds"),
         "--shard-size", "64KiB", "--no-progress"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    job = tmp_path / "job"  # where the user submits from: the job's output lands there
    job.mkdir()
    env = {
        "SHARDIO_DATA": "../ds",  # relative to where slurm.sh runs: it makes paths absolute
        "SHARDIO_CKPT_DIR": "ckpt",
        "TASKS_PER_NODE": "2",
        "GPUS_PER_NODE": "0",
        "CPUS_PER_TASK": "1",
        "WORKERS": "1",
        "BATCH_SIZE": "8",
        "STEPS": "4",
        "PYTHON": sys.executable,
        "TMPDIR": str(nvme),  # the node-local disk `shardio stage` stages to
    }
    # --parsable (passed on to sbatch): the job id, to wait for it closer than sbatch --wait
    proc = slurm_cluster.run(
        [REPO / "examples" / "slurm.sh", "--parsable"], cwd=job, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    done = slurm_cluster.wait_job(proc.stdout.strip().split(";")[0], timeout_s=240)
    logs = list(job.glob("shardio-train-*.out"))
    log = logs[0].read_text() if logs else "(no output file)"
    assert (done.state, done.exit_code) == ("COMPLETED", "0:0"), log
    for rank in (0, 1):
        assert f"rank {rank}/2: no checkpoint: a fresh start" in log, log
        assert f"rank {rank}/2: done: 4 steps" in log, log
    assert f"try 1 starts from scratch: no checkpoint in {job / 'ckpt'} yet" in log
    ckpts = sorted(p.name for p in (job / "ckpt").glob("checkpoint_*"))
    assert ckpts[-1].endswith("_full_step000000000000003"), ckpts
    assert [p for p in nvme.rglob("*") if p.is_file()] == []  # the staged copies are gone
    assert "job ends with exit 0" in log
