"""The one-host SLURM cluster for tests: bring it up and down with scripts/slurm/cluster.sh.

A cluster is a real munged, slurmctld and one slurmd per node on this machine, listening on
127.0.0.1, with its configuration, munge key and socket under a directory of its own. The
tests under tests/slurm share the session's cluster (the ``slurm_cluster`` fixture); a test
that needs several nodes takes the session's two-node cluster (``slurm_cluster2``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence

import pytest
from mfsbed import reap_orphans, run_shielded

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm" / "cluster.sh"
VENV_BIN = pathlib.Path(sys.executable).parent

# SHARDIO_SLURM=required (CI) turns a cluster that cannot start into a failure instead of a
# skip; SHARDIO_SLURM=off skips the slurm tests outright.
REQUIRED = os.environ.get("SHARDIO_SLURM", "") == "required"
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol")
OWNER_FILE = ".shardio-cluster-owner"  # in a cluster's directory: the pid of its test session
MARKER = ".shardio-slurm-cluster"  # what cluster.sh up writes first

# Variables of the caller's shell that would change what the jobs do.
_SCRUBBED_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SHARDIO_", "RETRY_SRUN_")
_SCRUBBED = {"TMPDIR", "MASTER_ADDR", "MASTER_PORT", "TRAIN_CMD", "LOCAL_RANK", "RANK"}


class ClusterError(RuntimeError):
    """The cluster could not be started, or a command on it failed."""


def unavailable_reason() -> str | None:
    """Why no cluster can start here (not root, no slurm-wlm or munge), or None."""
    if os.environ.get("SHARDIO_SLURM", "") == "off":
        return "SHARDIO_SLURM=off"
    if os.geteuid() != 0:
        return "the SLURM cluster needs root (its daemons run as SlurmUser root)"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"no {', '.join(missing)}: install the Debian packages slurm-wlm and munge"
    return None


def need_cluster() -> None:
    """Skip the test where no cluster can start; fail it under SHARDIO_SLURM=required."""
    reason = unavailable_reason()
    if reason is not None:
        if REQUIRED:
            pytest.fail(f"SHARDIO_SLURM=required but {reason}")
        pytest.skip(reason)


def cluster_root() -> pathlib.Path:
    """A new cluster directory: short and outside pytest's basetemp (munged's socket lies
    under it, and a socket path is limited to about 100 bytes)."""
    return pathlib.Path(tempfile.gettempdir()) / f"shardio-slurm-{uuid.uuid4().hex[:10]}"


@dataclasses.dataclass(frozen=True)
class Job:
    """A finished batch job as ``scontrol show job`` reports it."""

    job_id: str
    state: str  # COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
    exit_code: str  # "rc:signal", e.g. "0:0"
    fields: Mapping[str, str]


@dataclasses.dataclass
class Cluster:
    """A running cluster: its directory, slurm.conf and node names."""

    root: pathlib.Path
    conf: pathlib.Path
    nodes: tuple[str, ...]

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a client (sbatch, srun, a job): this cluster's SLURM_CONF,
        this venv's bin first on PATH, no SLURM or shardio knobs of the caller's shell."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(_SCRUBBED_PREFIXES) and k not in _SCRUBBED
        }
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([str(VENV_BIN), env.get("PATH", "")])
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("PYTHONWARNINGS", None)
        env.update(extra or {})
        return env

    def run(
        self,
        argv: Sequence[str | os.PathLike[str]],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run a client command (srun, sbatch, scripts/slurm/*.sh) against this cluster."""
        return subprocess.run(
            [os.fspath(a) for a in argv],
            capture_output=True,
            text=True,
            env=self.env(env),
            cwd=cwd,
            timeout=timeout,
            check=False,
        )

    def srun(
        self, *args: str | os.PathLike[str], timeout: float = 60.0, **kwargs: object
    ) -> subprocess.CompletedProcess[str]:
        """``srun ARGS`` with a wall-clock limit (srun --time is in minutes: too coarse)."""
        return self.run(["srun", *args], timeout=timeout, **kwargs)  # type: ignore[arg-type]

    def sbatch(
        self,
        *args: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> str:
        """Submit a batch job (``sbatch --parsable ARGS``); its job id."""
        proc = self.run(["sbatch", "--parsable", *args], env=env, cwd=cwd, timeout=30)
        if proc.returncode != 0:
            raise ClusterError(f"sbatch {' '.join(map(str, args))}: {proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> Job:
        """The job's record from ``scontrol show job`` (kept MinJobAge seconds after it ends)."""
        proc = self.run(["scontrol", "-o", "show", "job", job_id], timeout=30)
        if proc.returncode != 0:
            raise ClusterError(f"scontrol show job {job_id}: {proc.stderr.strip()}")
        fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
        return Job(job_id, fields.get("JobState", "?"), fields.get("ExitCode", "?"), fields)

    def wait_job(self, job_id: str, timeout_s: float = 90.0) -> Job:
        """Poll until the job has ended; cancel it and raise after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if job.state not in {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"}:
                return job
            if time.monotonic() > end:
                self.run(["scancel", job_id], timeout=30)
                raise ClusterError(f"job {job_id} still {job.state} after {timeout_s:.0f} s")
            time.sleep(0.3)

    def cancel_leftovers(self) -> list[str]:
        """Cancel the jobs still queued or running (a test that failed or timed out left
        them), so that they hold no CPUs the next test needs; their ids."""
        proc = self.run(["squeue", "-h", "-o", "%i"], timeout=30)
        jobs = proc.stdout.split() if proc.returncode == 0 else []
        if jobs:
            self.run(["scancel", "--full", *jobs], timeout=30)
        return jobs

    def down(self) -> None:
        proc = run_shielded([str(SCRIPT), "down", str(self.root)], timeout=120)
        if proc.returncode != 0:
            raise ClusterError(f"cluster.sh down: {proc.stderr.strip()}")


def start_cluster(root: os.PathLike[str] | str, *, nodes: int = 1) -> Cluster:
    """Start a cluster in ``root`` (new or empty); the caller must call :meth:`Cluster.down`."""
    root = pathlib.Path(root)
    argv = [str(SCRIPT), "up", str(root), "--nodes", str(nodes)]
    try:
        proc = run_shielded(argv, timeout=120)
    except BaseException:
        # Interrupted or timed out: leave nothing behind of a cluster nobody will own.
        if (root / MARKER).exists():
            run_shielded([str(SCRIPT), "down", str(root)], timeout=120)
        raise
    if proc.returncode != 0:
        if (root / MARKER).exists():  # a half-started cluster of ours: take it down
            run_shielded([str(SCRIPT), "down", str(root)], timeout=120)
        raise ClusterError(f"the SLURM cluster did not start: {proc.stderr.strip()[-2000:]}")
    exports = dict(re.findall(r"^export (\w+)=(\S+)$", proc.stdout, flags=re.MULTILINE))
    names = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N"],
        capture_output=True,
        text=True,
        env={**os.environ, "SLURM_CONF": exports["SLURM_CONF"]},
        timeout=30,
        check=True,
    ).stdout.split()
    (root / OWNER_FILE).write_text(f"{os.getpid()}\n")
    return Cluster(root=root, conf=pathlib.Path(exports["SLURM_CONF"]), nodes=tuple(names))


def reap_orphan_clusters(base: pathlib.Path) -> list[pathlib.Path]:
    """The clusters under ``base`` whose owning session is gone, taken down
    (:func:`mfsbed.reap_orphans`)."""
    markers = list(base.glob(f"shardio-slurm-*/{MARKER}"))
    return reap_orphans(markers, SCRIPT, OWNER_FILE, timeout=120)


def cpus_allowed_list(status_text: str) -> str:
    """The ``Cpus_allowed_list`` of a /proc/<pid>/status text."""
    for line in status_text.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise ValueError("no Cpus_allowed_list line")
