"""Fixtures of the SLURM tests: a real one-host cluster (scripts/slurm/cluster.sh).

Every test here is marked ``slurm``. Without root or without slurm-wlm and munge the tests
skip; under ``SHARDIO_SLURM=required`` (CI) a cluster that cannot start fails them instead,
and a slurm test that skips fails the run (see ``pytest_terminal_summary`` in
tests/conftest.py).
"""

from __future__ import annotations

import pathlib
import signal
import tempfile
from collections.abc import Iterator
from types import FrameType

import pytest
from slurmbed import (
    REQUIRED,
    Cluster,
    ClusterError,
    cluster_root,
    need_cluster,
    reap_orphan_clusters,
    start_cluster,
)

from shardio.packing.run import PackOptions, pack

HERE = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if pathlib.Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.slurm)


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _teardown_on_sigterm() -> None:
    """Make SIGTERM (a CI timeout, ``kill``) unwind like Ctrl-C, so the clusters' finalizers
    run and take them down; a default SIGTERM would end pytest and leave the daemons running."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)


def _session_cluster(nodes: int) -> Iterator[Cluster]:
    need_cluster()
    _teardown_on_sigterm()
    reap_orphan_clusters(pathlib.Path(tempfile.gettempdir()))
    try:
        cluster = start_cluster(cluster_root(), nodes=nodes)
    except ClusterError as exc:
        pytest.fail(str(exc)) if REQUIRED else pytest.skip(str(exc))
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.fixture(autouse=True)
def _cancel_leftover_jobs(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, the jobs it left on the session's clusters are cancelled: a test
    that failed or timed out must not hold the CPUs the next test's job waits for."""
    yield
    for name in ("slurm_cluster", "slurm_cluster2"):
        if name in request.fixturenames:
            request.getfixturevalue(name).cancel_leftovers()


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    """The session's one-node cluster: node ``$(hostname)`` with this machine's CPUs."""
    yield from _session_cluster(1)


@pytest.fixture(scope="session")
def slurm_cluster2() -> Iterator[Cluster]:
    """The session's two-node cluster: two slurmd on this host (node1, node2), each
    claiming all of this machine's CPUs (Debian builds Slurm with multiple-slurmd)."""
    yield from _session_cluster(2)


@pytest.fixture(scope="session")
def slurm_tree(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A source tree of 24 small files in two classes (read-only by convention)."""
    src = tmp_path_factory.mktemp("slurm-tree") / "src"
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
        for i in range(12):
            payload = f"{cls}-{i}-".encode() * (200 + 53 * i)
            (src / cls / f"{cls}{i:02d}.bin").write_bytes(payload)
    return src


@pytest.fixture(scope="session")
def slurm_dataset(slurm_tree: pathlib.Path) -> pathlib.Path:
    """``slurm_tree`` packed into 8 KiB tar shards (several shards). Read-only: copy it to
    damage it."""
    dst = slurm_tree.parent / "ds"
    result = pack(str(slurm_tree), str(dst), PackOptions(shard_size_bytes=8 * 1024, workers=1))
    assert result.num_shards >= 4, result
    return dst
