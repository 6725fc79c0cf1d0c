"""Fixtures of the parallel-filesystem tests: a real MooseFS bed (scripts/pfs/moosefs.sh).

Every test here is marked ``pfs``. Without root the tests skip; under ``SHARDIO_PFS=required``
(CI) a bed that cannot start fails them instead, and a pfs test that skips fails the run (see
``pytest_terminal_summary`` in tests/conftest.py).
"""

from __future__ import annotations

import pathlib
import signal
import tempfile
import uuid
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest
from mfsbed import (
    REQUIRED,
    Bed,
    BedError,
    PfsDataset,
    reap_orphan_beds,
    source_payload,
    start_bed,
    unavailable_reason,
)

HERE = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if pathlib.Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.pfs)


def _need_bed() -> None:
    reason = unavailable_reason()
    if reason is not None:
        if REQUIRED:
            pytest.fail(f"SHARDIO_PFS=required but {reason}")
        pytest.skip(reason)


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _teardown_on_sigterm() -> None:
    """Make SIGTERM (a CI timeout, ``kill``) unwind like Ctrl-C, so the beds' finalizers
    run and take them down; a default SIGTERM would end pytest and leave them running."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)


def _bed_root() -> pathlib.Path:
    # Short and outside pytest's basetemp: the bed's directory names its network namespace.
    return pathlib.Path(tempfile.gettempdir()) / f"shardio-bed-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def pfs_bed() -> Iterator[Bed]:
    """The session's shared bed: 2 chunkservers, one copy of each chunk, default retries.

    Tests must not stop its servers (take :func:`private_bed` for that) and must write only
    under a directory of their own (``pfs_dir``).
    """
    _need_bed()
    _teardown_on_sigterm()
    reap_orphan_beds(pathlib.Path(tempfile.gettempdir()))
    try:
        bed = start_bed(_bed_root(), chunkservers=2)
    except BedError as exc:
        pytest.fail(str(exc)) if REQUIRED else pytest.skip(str(exc))
    try:
        yield bed
    finally:
        bed.down()


@pytest.fixture
def pfs_dir(pfs_bed: Bed, request: pytest.FixtureRequest) -> pathlib.Path:
    """A fresh directory on the shared bed's mount, for one test."""
    name = f"{request.node.name[:60]}-{uuid.uuid4().hex[:6]}"
    path = pfs_bed.mount / "t" / "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
    path.mkdir(parents=True)
    return path


@pytest.fixture
def private_bed() -> Iterator[Callable[..., Bed]]:
    """A factory of beds for one test (to stop a chunkserver or the master in): each bed it
    starts is taken down after the test. ``private_bed(chunkservers=2, ioretries=3, goal=1)``."""
    _need_bed()
    _teardown_on_sigterm()
    beds: list[Bed] = []

    def make(**kwargs: int) -> Bed:
        try:
            bed = start_bed(_bed_root(), **kwargs)
        except BedError as exc:
            pytest.fail(str(exc)) if REQUIRED else pytest.skip(str(exc))
        beds.append(bed)
        return bed

    try:
        yield make
    finally:
        errors = []
        for bed in beds:  # every bed, even when taking one down failed
            try:
                bed.down()
            except (BedError, OSError) as exc:
                errors.append(str(exc))
        if errors:
            raise BedError("; ".join(errors))


# --------------------------------------------------------------------------- datasets
@pytest.fixture(scope="session")
def pfs_dataset(pfs_bed: Bed, small_tree: pathlib.Path, run_cli: Callable[..., Any]) -> PfsDataset:
    """``small_tree`` packed onto the shared bed in 256 KiB tar shards, verified."""
    dst = pfs_bed.mount / "shared" / f"small-{uuid.uuid4().hex[:6]}"
    result = run_cli(
        "pack", small_tree, dst, "--shard-size", "256KiB", "--workers", "2", "--no-progress"
    )
    assert result.rc == 0, result.stderr
    return PfsDataset(path=dst, source=small_tree, payload=source_payload(small_tree))
