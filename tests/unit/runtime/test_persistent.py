"""Persistent workers: ShardLoader keeps its workers from one epoch to the next.

The workers learn each run's epoch and position from a small shared board, so every epoch
delivers ShardDataset's order exactly, a resume is exact, and an iteration left early starts
new workers. Workers are counted by their init function (a file per worker start).
"""

from __future__ import annotations

import os
import pathlib
import signal
import time
from typing import Any

import pytest
from resuming import assert_resumed_exactly, resumed, saved

from shardio.errors import UsageError
from shardio.order.ranks import RankInfo
from shardio.runtime.dataset import ShardDataset
from shardio.runtime.loader import ShardLoader

Packed = Any


class _CountStarts:
    """A worker_init_fn that leaves one file per worker start (picklable for spawn)."""

    def __init__(self, where: pathlib.Path) -> None:
        self.where = str(where)

    def __call__(self, worker_id: int) -> None:
        path = os.path.join(self.where, f"{os.getpid()}-{worker_id}")
        open(path, "w").close()


def _keys(loader: ShardLoader) -> list[str]:
    return [k for batch in loader for k in batch["__key__"]]


def _order(path: pathlib.Path, mode: str, epoch: int, consumed: int = 0) -> list[str]:
    ds = ShardDataset(path, mode=mode, seed=5, ranks=RankInfo())
    ds.set_epoch(epoch)
    keys = [ds.packed.index.key(int(i)) for i in ds.rank_indices(consumed=consumed)]
    ds.close()
    return keys


@pytest.mark.parametrize("mode", ["map", "stream"])
@pytest.mark.parametrize("persistent", [True, False])
def test_every_epoch_is_shard_datasets_order_and_workers_start_once(
    packed_tar: Packed, tmp_path: pathlib.Path, mode: str, persistent: bool
) -> None:
    ds = ShardDataset(packed_tar.path, mode=mode, seed=5, ranks=RankInfo())
    loader = ds.loader(
        batch_size=32, num_workers=2, persistent_workers=persistent,
        worker_init_fn=_CountStarts(tmp_path),
    )  # fmt: skip
    try:
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert _keys(loader) == _order(packed_tar.path, mode, epoch), f"epoch {epoch}"
        assert _keys(loader) == _order(packed_tar.path, mode, 2)  # read again, no set_epoch
    finally:
        loader.close()
    assert len(os.listdir(tmp_path)) == (2 if persistent else 2 * 4)


def test_a_state_loaded_at_the_end_of_an_epoch_stays_there(packed_tar: Packed) -> None:
    ds = ShardDataset(packed_tar.path, seed=5, ranks=RankInfo())
    loader = ds.loader(batch_size=32, num_workers=2)
    _keys(loader)
    state = loader.state_dict()
    loader.close()
    again = ShardDataset(packed_tar.path, seed=5, ranks=RankInfo()).loader(batch_size=32)
    again.load_state_dict(state)
    assert _keys(again) == []  # resumed at the end: nothing twice
    assert len(_keys(again)) == len(ds)  # then read to its end here: read again


@pytest.mark.parametrize("mode", ["map", "stream"])
def test_an_iteration_left_early_continues_exactly_with_new_workers(
    packed_tar: Packed, tmp_path: pathlib.Path, mode: str
) -> None:
    ds = ShardDataset(packed_tar.path, mode=mode, seed=5, ranks=RankInfo())
    loader = ds.loader(batch_size=32, num_workers=2, worker_init_fn=_CountStarts(tmp_path))
    try:
        _keys(loader)  # epoch 0 read whole: the workers are kept
        loader.set_epoch(1)
        head: list[str] = []
        for i, batch in enumerate(loader):
            head += batch["__key__"]
            if i == 4:
                break
        state = loader.state_dict()
        rest = _keys(loader)
        assert head + rest == _order(packed_tar.path, mode, 1)
        assert len(os.listdir(tmp_path)) == 4  # the break ended the kept workers
    finally:
        loader.close()
    # A new loader resumes from the state saved mid-epoch, with persistent workers.
    again = resumed(
        lambda: ShardDataset(packed_tar.path, mode=mode, seed=5, ranks=RankInfo()).loader(
            batch_size=32, num_workers=2
        ),
        saved(state),
    )
    try:
        assert_resumed_exactly(head, _keys(again), head + rest)
        again.set_epoch(2)
        assert _keys(again) == _order(packed_tar.path, mode, 2)
    finally:
        again.close()


def test_forkserver_workers_open_each_shard_once_over_epochs(packed_tar: Packed) -> None:
    ds = ShardDataset(packed_tar.path, mode="stream", seed=5, ranks=RankInfo())
    loader = ds.loader(batch_size=32, num_workers=2, multiprocessing_context="forkserver")
    opens = []
    try:
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert _keys(loader) == _order(packed_tar.path, "stream", epoch)
            counts = loader.metrics().counters
            opens.append(counts["opens_source"] + counts["opens_staged"])
    finally:
        loader.close()
    # Each worker opens the shards it reads in epoch 0; the kept workers open none again.
    assert opens[0] >= packed_tar.num_shards
    assert opens[2] == opens[1] == opens[0], opens


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_a_bad_persistent_workers_is_refused(packed_tar: Packed, bad: object) -> None:
    ds = ShardDataset(packed_tar.path, ranks=RankInfo())
    with pytest.raises(UsageError, match="persistent_workers must be True or False"):
        ShardLoader(ds, batch_size=4, num_workers=2, persistent_workers=bad)  # type: ignore[arg-type]


def test_a_kept_worker_killed_between_epochs_is_replaced_not_raised(
    packed_tar: Packed, tmp_path: pathlib.Path
) -> None:
    # The OOM killer takes an idle worker between epochs: torch's SIGCHLD handler must not
    # raise in the training loop; the next epoch starts new workers and is exact.
    ds = ShardDataset(packed_tar.path, seed=5, ranks=RankInfo())
    loader = ds.loader(batch_size=32, num_workers=2, worker_init_fn=_CountStarts(tmp_path))
    try:
        _keys(loader)
        victim = int(sorted(os.listdir(tmp_path))[0].split("-")[0])
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # reaped by its parent's SIGCHLD handling
            try:
                os.kill(victim, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        time.sleep(0.2)  # a SIGCHLD handler that raised would have raised by now
        loader.set_epoch(1)
        assert _keys(loader) == _order(packed_tar.path, "map", 1)
        assert len(os.listdir(tmp_path)) == 4  # two new workers
    finally:
        loader.close()
