"""Checkpointer: in the background, on the cadence, failures raised by the next call."""

from __future__ import annotations

import errno
import pathlib
import threading

import pytest
import torch
from checkpointing import JOB, assert_state, state_of

from shardio.checkpoint import Checkpointer, load_latest
from shardio.checkpoint import saver as saver_module
from shardio.checkpoint import writing as writing_module
from shardio.checkpoint.lease import LEASE_NAME
from shardio.errors import CheckpointError, StorageError, UsageError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch):
    """Background saves wait for ``held.set()`` before writing."""
    gate = threading.Event()
    real = saver_module.run_save_bounded

    def slow(*args, **kwargs):
        assert gate.wait(30), "the test never released the save"
        return real(*args, **kwargs)

    monkeypatch.setattr(saver_module, "run_save_bounded", slow)
    yield gate
    gate.set()


def test_save_returns_before_the_write_and_saves_the_state_of_the_call(
    ckdir: pathlib.Path, held: threading.Event
) -> None:
    state = state_of(1)
    with Checkpointer(ckdir, environ=JOB) as saver:
        saver.save(state, step=1)
        assert saver.busy and not list(ckdir.glob("checkpoint_*"))
        state["model"]["w"].add_(1.0)  # training goes on changing its tensors in place
        state["optimizer"]["step"] = 99
        held.set()
        saver.wait()
        assert not saver.busy and saver.last_path is not None
    assert_state(load_latest(ckdir).state, 1)


def test_a_background_failure_is_raised_by_the_next_call(
    ckdir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = writing_module.write_rank

    def fails_once(*args, **kwargs):
        monkeypatch.setattr(writing_module, "write_rank", real)
        raise StorageError(errno.EIO, "writing the rank file failed: EIO")

    with Checkpointer(ckdir, environ=JOB) as saver:
        saver.save(state_of(1), step=1)
        saver.wait()
        monkeypatch.setattr(writing_module, "write_rank", fails_once)
        saver.save(state_of(2), step=2)  # fails in the background
        with pytest.raises(CheckpointError, match="step 2 failed") as info:
            saver.wait()
        assert isinstance(info.value.__cause__, StorageError)
        assert "EIO" in str(info.value.__cause__)
        saver.save(state_of(3), step=3)  # raised once: the saver goes on
    assert load_latest(ckdir).step == 3
    assert not [p for p in ckdir.iterdir() if p.name.startswith(".checkpoint")]


def test_the_cadence_full_and_light(ckdir: pathlib.Path) -> None:
    clock = Clock()
    kinds = []
    with Checkpointer(
        ckdir, full_every_s=100, light_every_s=30, keep_full=2, keep_light=1, clock=clock,
        environ=JOB,
    ) as saver:  # fmt: skip
        for step in range(0, 251):
            clock.now = float(step)
            kind = saver.maybe_save(
                step, full=lambda s=step: state_of(s), light=lambda s=step: {"light": s}
            )
            if kind:
                kinds.append((step, kind))
                saver.wait()
    assert kinds == [(30, "light"), (60, "light"), (90, "light"), (100, "full"),
                     (130, "light"), (160, "light"), (190, "light"), (200, "full"),
                     (230, "light")]  # fmt: skip
    names = sorted(p.name for p in ckdir.iterdir() if p.name != LEASE_NAME)
    assert len(names) == 3 and sum("_full_" in n for n in names) == 2
    ck = load_latest(ckdir)
    assert (ck.step, ck.kind) == (230, "light") and ck.state == {"light": 230}
    assert load_latest(ckdir, kind="full").step == 200


def test_due_checkpoints_coalesce_while_one_is_in_flight(
    ckdir: pathlib.Path, held: threading.Event
) -> None:
    clock = Clock()
    made = []
    with Checkpointer(ckdir, full_every_s=1000, light_every_s=10, clock=clock,
                      environ=JOB) as saver:  # fmt: skip
        saver.maybe_save(0, light=lambda: made.append(0))
        clock.now = 10
        assert saver.maybe_save(10, light=lambda: made.append(10) or {"s": 10}) == "light"
        for step in range(11, 40):  # due again at 20 and 30: never waits, takes none
            clock.now = step
            assert saver.maybe_save(step, light=lambda s=step: made.append(s) or {}) is None
        held.set()
        saver.wait()
        clock.now = 40
        assert saver.maybe_save(40, light=lambda: made.append(40) or {"s": 40}) == "light"
    assert made == [10, 40]  # the state is made only when a save starts


def test_a_stalled_save_is_an_error_within_the_bound(
    ckdir: pathlib.Path, held: threading.Event
) -> None:
    saver = Checkpointer(ckdir, stall_timeout_s=0.3, environ=JOB)
    saver.save({"x": 1}, step=1)
    with pytest.raises(CheckpointError, match=r"not finished after 0\.3 s"):
        saver.wait()
    with pytest.raises(CheckpointError, match="not finished"):
        saver.save({"x": 2}, step=2)  # waits for the one in flight, bounded too
    held.set()
    saver.close()
    assert load_latest(ckdir).step == 1


def test_the_loader_rides_in_every_checkpoint(ckdir: pathlib.Path, packed_small) -> None:
    from shardio import ShardDataset

    loader = ShardDataset(packed_small("tar", "256KiB", 1)[0], seed=1).loader(
        batch_size=4, num_workers=0
    )
    it = iter(loader)
    next(it), next(it)
    with Checkpointer(ckdir, loader=loader, environ=JOB) as saver:
        saver.save({"w": torch.zeros(2)}, step=2)
    ck = load_latest(ckdir)
    assert ck.loader_state == loader.state_dict() and ck.manifest.loader["consumed"] == 8


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"full_every_s": 0}, "full_every_s"), ({"light_every_s": float("inf")}, "light_every_s"),
     ({"keep_full": 0}, "keep_full"), ({"keep_light": 1.5}, "keep_light"),
     ({"stall_timeout_s": -1}, "stall_timeout_s"), ({"level": 0}, "level")],
)  # fmt: skip
def test_bad_settings_are_refused(ckdir: pathlib.Path, kwargs, needle) -> None:
    with pytest.raises(UsageError, match=needle):
        Checkpointer(ckdir, environ=JOB, **kwargs)


def test_closed_means_closed(ckdir: pathlib.Path) -> None:
    saver = Checkpointer(ckdir, environ=JOB)
    saver.close()
    with pytest.raises(UsageError, match="closed"):
        saver.save({"x": 1}, step=1)
    assert not ckdir.exists()  # made by the first save, not by the constructor


def test_buffers_are_reused_and_each_save_holds_its_own_state(ckdir: pathlib.Path) -> None:
    state = state_of(1)
    with Checkpointer(ckdir, keep_full=5, environ=JOB) as saver:
        saver.save(state, step=1)
        saver.wait()
        first = saver._buffers
        saver.save(state_of(2), step=2)
        saver.wait()
        assert [b.data_ptr() for b in saver._buffers] == [b.data_ptr() for b in first]
    ck = load_latest(ckdir)
    assert_state(ck.state, 2)
    from shardio.checkpoint.audit import verify_checkpoints

    assert all(i.intact for i in verify_checkpoints(str(ckdir)))
