"""EpochCursor: the one owner of the epoch position, torch-free, with a versioned state."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest

from shardio.errors import UsageError
from shardio.order.cursor import STATE_VERSION, EpochCursor
from shardio.order.ranks import RankInfo
from shardio.order.spec import OrderSpec

SIZES = [7, 0, 13, 5, 9, 11]


def _walk(cursor: EpochCursor, steps: int) -> list[int]:
    """Take ``steps`` samples the way a loader does: from the stream, advancing."""
    world = cursor.ranks().world_size
    got = [int(i) for i in cursor.stream().materialise()[:steps]]
    cursor.advance(len(got) * world)
    return got


@pytest.mark.parametrize("order", ["random", "shard-local", "sequential"])
def test_save_restore_matches_an_uninterrupted_epoch(order: str) -> None:
    spec = OrderSpec(order=order, seed=3)
    whole = EpochCursor(spec, SIZES, ranks=RankInfo(rank=1, world_size=2))
    whole.set_epoch(2)
    expected = [int(i) for i in whole.stream().materialise()]
    first = EpochCursor(spec, SIZES, ranks=RankInfo(rank=1, world_size=2))
    first.set_epoch(2)
    head = _walk(first, 5)
    saved = first.state()
    assert saved["version"] == STATE_VERSION and saved["consumed"] == 10
    resumed = EpochCursor(spec, SIZES, ranks=RankInfo(rank=1, world_size=2))
    resumed.load(saved)
    assert head + [int(i) for i in resumed.stream().materialise()] == expected


def test_a_new_epoch_starts_at_its_beginning_and_copies_are_independent() -> None:
    cursor = EpochCursor(OrderSpec(seed=1), SIZES, ranks=RankInfo())
    _walk(cursor, 4)
    twin = cursor.copy()
    cursor.set_epoch(1)
    assert (cursor.epoch, cursor.consumed) == (1, 0)
    assert (twin.epoch, twin.consumed) == (0, 4)
    cursor.set_epoch(1)  # the same epoch: the position stays
    _walk(cursor, 2)
    cursor.set_epoch(1)
    assert cursor.consumed == 2


def test_pickles_without_its_caches() -> None:
    cursor = EpochCursor(OrderSpec(seed=1), SIZES, ranks=RankInfo())
    cursor.stream()
    cursor.epoch_order()
    copy = pickle.loads(pickle.dumps(cursor))
    assert copy._streams == {} and copy._order is None
    assert np.array_equal(copy.stream().materialise(), cursor.stream().materialise())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_samples": 44}, "num_samples=44"),
        ({"spec": {"order": "sequential", "seed": 1}}, "another order"),
        ({"consumed": 10_000}, "more than its"),
        ({"consumed": 1.5}, "must be an integer"),
        ({"version": 9}, "unsupported ShardDataset state version 9"),
        ({"history": "x"}, "'history' must be a list"),
    ],
)
def test_a_wrong_state_is_refused_in_one_line(change: dict[str, object], message: str) -> None:
    cursor = EpochCursor(OrderSpec(seed=1), SIZES, ranks=RankInfo())
    state = {**cursor.state(), **change}
    with pytest.raises(UsageError, match=message):
        cursor.load(state)
    assert (cursor.epoch, cursor.consumed) == (0, 0)  # nothing half-loaded


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(UsageError, match="spec must be an OrderSpec"):
        EpochCursor("random", SIZES)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="ranks must be a RankInfo"):
        EpochCursor(OrderSpec(), SIZES, ranks=(0, 1))  # type: ignore[arg-type]
    cursor = EpochCursor(OrderSpec(), SIZES)
    for bad in (-1, True, 1.0):
        with pytest.raises(UsageError):
            cursor.set_epoch(bad)  # type: ignore[arg-type]
        with pytest.raises(UsageError):
            cursor.advance(bad)  # type: ignore[arg-type]


def test_the_cursor_imports_no_torch() -> None:
    probe = "import sys, shardio.order.cursor; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    assert out == "False"
