"""The ranks' meeting place: rank 0 makes the save's temp directory, the others wait for it.
A directory that appears while a rank looks is found (one lstat per look: the race that
failed a two-rank save in CI, where the look saw nothing and then something); anything
else at its name (a file, a symlink to a directory) is refused in one line."""

from __future__ import annotations

import os
import pathlib
import threading
import time
from typing import Any

import pytest

from shardio.checkpoint.lease import LEASE_NAME
from shardio.checkpoint.naming import Identity
from shardio.checkpoint.store import Plan, make_temp_dir
from shardio.errors import CheckpointError


def _plan(folder: pathlib.Path, rank: int) -> Plan:
    ident = Identity(rank=rank, world_size=2, hosts=("h", "h"), job_id="7")
    return Plan(
        directory=str(folder), identity=ident, kind="full", step=3, token="ab12cd34ef56ab78"
    )


def test_a_directory_made_between_two_looks_is_found(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _plan(tmp_path, 1)
    real_lstat = os.lstat
    looks = []

    def lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if os.fspath(path) == plan.temp_dir and not looks:
            looks.append(path)
            os.mkdir(plan.temp_dir)  # rank 0, just after this look found nothing
            raise FileNotFoundError(path)
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", lstat)
    make_temp_dir(plan, layout=None)
    assert looks


def test_rank_one_waits_for_rank_zero(tmp_path: pathlib.Path) -> None:
    errors: list[BaseException] = []

    def wait(folder: pathlib.Path) -> None:
        try:
            make_temp_dir(_plan(folder, 1), layout=None)
        except BaseException as exc:
            errors.append(exc)

    for round_ in range(10):
        folder = tmp_path / f"r{round_}"
        folder.mkdir()
        waiter = threading.Thread(target=wait, args=(folder,))
        waiter.start()
        time.sleep(0.002 * (round_ % 5))
        make_temp_dir(_plan(folder, 0), layout=None)
        waiter.join(timeout=30)
        assert not waiter.is_alive() and errors == []


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_something_else_at_its_name_is_refused(tmp_path: pathlib.Path, kind: str) -> None:
    plan = _plan(tmp_path, 1)
    if kind == "file":
        pathlib.Path(plan.temp_dir).write_text("not mine")
    else:
        (tmp_path / "elsewhere").mkdir()
        os.symlink(tmp_path / "elsewhere", plan.temp_dir)
    with pytest.raises(CheckpointError, match="is not a directory shardio made"):
        make_temp_dir(plan, layout=None)


def test_the_others_see_it_only_once_its_layout_is_set(tmp_path: pathlib.Path) -> None:
    """A file takes its directory's stripe layout when it is created: rank 1 must not find
    the directory (and create its file there) before rank 0 has set the layout."""
    laid: list[str] = []
    seen_by_rank1: list[bool] = []

    def layout(path: str) -> None:
        time.sleep(0.3)  # a slow `lfs setstripe`
        laid.append(path)

    def rank1() -> None:
        make_temp_dir(_plan(tmp_path, 1), layout=None)
        seen_by_rank1.append(bool(laid))

    waiter = threading.Thread(target=rank1)
    waiter.start()
    make_temp_dir(_plan(tmp_path, 0), layout=layout)
    waiter.join(timeout=30)
    assert seen_by_rank1 == [True]
    plan = _plan(tmp_path, 0)
    assert os.path.isdir(plan.temp_dir) and laid == [plan.temp_dir + ".new"]
    # the directory's lease (rank 0's job) and the temp directory, nothing else
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(plan.temp_dir), LEASE_NAME])


def test_a_failed_layout_leaves_nothing_behind(tmp_path: pathlib.Path) -> None:
    def layout(path: str) -> None:
        raise CheckpointError(5, f"lfs setstripe {path} failed")

    with pytest.raises(CheckpointError, match="setstripe"):
        make_temp_dir(_plan(tmp_path, 0), layout=layout)
    assert os.listdir(tmp_path) == []


def test_a_staging_directory_someone_else_made_is_left_alone(tmp_path: pathlib.Path) -> None:
    plan = _plan(tmp_path, 0)
    os.mkdir(plan.temp_dir + ".new")
    (pathlib.Path(plan.temp_dir + ".new") / "theirs").write_text("x")
    with pytest.raises(CheckpointError, match="exists already"):
        make_temp_dir(plan, layout=None)
    assert (pathlib.Path(plan.temp_dir + ".new") / "theirs").read_text() == "x"
    assert not os.path.lexists(plan.temp_dir)


def test_a_staging_directory_a_killed_save_left_is_cleaned_up_later(
    tmp_path: pathlib.Path,
) -> None:
    """SIGKILL between rank 0's mkdir and its rename leaves ``<temp>.new``: a temp name,
    removed by the next save's cleanup of stale temps like any other."""
    from shardio.checkpoint.catalog import list_checkpoints
    from shardio.checkpoint.store import remove_stale_temps

    staging = _plan(tmp_path, 0).temp_dir + ".new"
    os.mkdir(staging)
    os.utime(staging, (time.time() - 100_000,) * 2)
    assert list_checkpoints(str(tmp_path)) == ([], [staging])
    remove_stale_temps(str(tmp_path), older_than_s=3600, keep=None)
    assert os.listdir(tmp_path) == []
