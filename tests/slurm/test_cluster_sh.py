"""scripts/slurm/cluster.sh: a real munged, slurmctld and slurmd on this machine."""

from __future__ import annotations

import os
import pathlib
import subprocess
import time

import pytest
from slurmbed import SCRIPT, Cluster, cluster_root, need_cluster, start_cluster


def conf_values(cluster: Cluster) -> dict[str, str]:
    """slurm.conf's single-valued settings (the first of each key)."""
    values: dict[str, str] = {}
    for line in cluster.conf.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#") and " " not in key:
            values.setdefault(key, value)
    return values


def listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp has them) listening on TCP ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            addr, _, hexport = fields[1].rpartition(":")
            if int(hexport, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.append(addr)
    return found


def daemon_pids(cluster: Cluster) -> dict[str, int]:
    """The daemons of the cluster by pid file name (munged, slurmctld, slurmd-NODE)."""
    return {p.stem: int(p.read_text()) for p in (cluster.root / "run").glob("*.pid")}


def test_the_node_is_idle_and_named_after_this_host(slurm_cluster: Cluster) -> None:
    proc = slurm_cluster.run(["sinfo", "-h", "-N", "-o", "%N %T %c"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [os.uname().nodename.split(".")[0], "idle", str(os.cpu_count())]


def test_the_daemons_listen_on_loopback_only(slurm_cluster: Cluster) -> None:
    values = conf_values(slurm_cluster)
    for key in ("SlurmctldPort", "SlurmdPort"):
        addrs = listening(int(values[key]))
        assert addrs == ["0100007F"], (key, addrs)  # 127.0.0.1, nothing on 0.0.0.0 or ::


def test_its_munge_key_and_socket_are_its_own(slurm_cluster: Cluster) -> None:
    values = conf_values(slurm_cluster)
    socket = pathlib.Path(values["AuthInfo"].removeprefix("socket="))
    assert socket.is_socket() and socket.is_relative_to(slurm_cluster.root)
    key = slurm_cluster.root / "munge" / "munge.key"
    assert key.stat().st_mode & 0o077 == 0
    if pathlib.Path("/etc/munge/munge.key").exists():
        assert key.read_bytes() != pathlib.Path("/etc/munge/munge.key").read_bytes()
    assert values["PlugStackConfig"].startswith(str(slurm_cluster.root))


def test_env_prints_what_a_client_needs(slurm_cluster: Cluster, tmp_path: pathlib.Path) -> None:
    proc = subprocess.run(
        [SCRIPT, "env", slurm_cluster.root], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"export SLURM_CONF={slurm_cluster.conf}\n"
    env = {k: v for k, v in slurm_cluster.env().items() if k != "SLURM_CONF"}
    shell = subprocess.run(
        ["bash", "-c", f'eval "$({SCRIPT} env {slurm_cluster.root})"; srun -n1 hostname'],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert shell.returncode == 0, shell.stderr
    assert shell.stdout.strip() == os.uname().nodename.split(".")[0]


def test_status_lists_the_running_daemons(slurm_cluster: Cluster) -> None:
    proc = subprocess.run(
        [SCRIPT, "status", slurm_cluster.root], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    for name, pid in daemon_pids(slurm_cluster).items():
        assert f"{name} running (pid {pid})" in proc.stdout
    assert set(daemon_pids(slurm_cluster)) == {
        "munged",
        "slurmctld",
        *(f"slurmd-{n}" for n in slurm_cluster.nodes),
    }


def test_a_second_cluster_runs_beside_the_first_and_down_stops_exactly_its_daemons(
    slurm_cluster: Cluster, tmp_path: pathlib.Path
) -> None:
    other = start_cluster(cluster_root())
    try:
        mine, theirs = conf_values(slurm_cluster), conf_values(other)
        for key in ("SlurmctldPort", "SlurmdPort", "AuthInfo", "SrunPortRange"):
            assert mine[key] != theirs[key], key
        for cluster in (slurm_cluster, other):
            proc = cluster.srun("-n1", "printenv", "SLURM_JOB_ID", cwd=tmp_path)
            assert proc.returncode == 0, proc.stderr
        pids: dict[str, int] = daemon_pids(other)
        assert len(pids) == 3
        # A job still running when the cluster goes down: its processes go with it.
        pid_file = tmp_path / "job.pid"
        job_id = other.sbatch(
            "-o", "/dev/null", "--wrap", f"echo $$ >{pid_file}; exec sleep 300", cwd=tmp_path
        )
        end = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert time.monotonic() < end, other.job(job_id)
            time.sleep(0.2)
        pids["job"] = int(pid_file.read_text())
    finally:
        other.down()
    for name, pid in pids.items():
        assert not pathlib.Path(f"/proc/{pid}").exists(), f"{name} (pid {pid}) still runs"
    assert not other.root.exists()
    for pid in daemon_pids(slurm_cluster).values():  # the first cluster is untouched
        assert pathlib.Path(f"/proc/{pid}").exists()
    proc = slurm_cluster.srun("-n1", "true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_two_nodes_are_two_slurmd_on_this_host(
    slurm_cluster2: Cluster, tmp_path: pathlib.Path
) -> None:
    assert slurm_cluster2.nodes == ("node1", "node2")
    proc = slurm_cluster2.srun(
        "-N2", "-n2", "bash", "-c", 'echo "$SLURM_NODEID $SLURMD_NODENAME"', cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["0 node1", "1 node2"]


def run_cluster_sh(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["up", "DIR", "--nodes", "two"], "--nodes takes a whole number, not 'two'"),
        (["up", "DIR", "--nodes", "0"], "--nodes takes 1 to 8"),
        (["up", "DIR", "--nodes", "99999999999999999999"], "--nodes takes 1 to 8"),
        (["up", "DIR", "--nodes"], "--nodes needs a number"),
        (["up", "DIR", "--bogus"], "unknown option for up: --bogus"),
        (["down", "DIR"], "holds no cluster (nothing of ours to stop)"),
        (["status", "DIR"], "holds no cluster"),
        (["env", "DIR"], "holds no cluster"),
        (["up", "/tmp/a b"], "must not contain whitespace"),
    ],
)
def test_bad_arguments_get_one_clear_line(
    tmp_path: pathlib.Path, args: list[str], message: str
) -> None:
    argv = [str(tmp_path / "c") if a == "DIR" else a for a in args]
    proc = run_cluster_sh(*argv)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("cluster.sh: "), proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "c").exists()  # nothing created


def test_usage_without_arguments() -> None:
    proc = run_cluster_sh("up")
    assert proc.returncode == 2
    assert "cluster.sh up DIR [--nodes N]" in proc.stderr


def test_up_refuses_a_directory_that_is_not_empty(tmp_path: pathlib.Path) -> None:
    need_cluster()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "mine.txt").write_text("keep me")
    proc = run_cluster_sh("up", tmp_path / "c")
    assert proc.returncode == 1
    assert "is not empty: give a new or empty directory" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["mine.txt"]


def daemons_of(root: pathlib.Path) -> list[str]:
    """Command lines of the processes that name ``root`` (munged's socket, SLURM_CONF)."""
    found = []
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = (proc / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(root) in cmdline or f"SLURM_CONF={root}/" in environ:
            found.append(cmdline)
    return found


def test_a_failed_up_says_why_and_leaves_nothing_running(tmp_path: pathlib.Path) -> None:
    need_cluster()
    shim = tmp_path / "bin"  # a slurmctld that cannot start, after munged has started
    shim.mkdir()
    (shim / "slurmctld").write_text("#!/bin/sh\necho 'slurmctld: fatal: cannot bind' >&2\nexit 1\n")
    (shim / "slurmctld").chmod(0o755)
    root = cluster_root()
    proc = subprocess.run(
        [SCRIPT, "up", root],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}"},
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr == "cluster.sh: slurmctld did not start: slurmctld: fatal: cannot bind\n"
    assert not root.exists()
    assert daemons_of(root) == []
