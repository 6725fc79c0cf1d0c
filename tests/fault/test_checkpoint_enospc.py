"""A checkpoint that does not fit (ENOSPC on a small tmpfs): a clear error, nothing half
written left behind, the previous checkpoint still the latest and loadable."""

from __future__ import annotations

import errno
import pathlib

import pytest
from checkpointing import assert_state, state_of

from shardio.checkpoint import Checkpointer, load_latest, save
from shardio.checkpoint.lease import LEASE_NAME
from shardio.errors import CheckpointError, StorageError

JOB = {"SLURM_JOB_ID": "7"}


def test_enospc_in_a_save(small_tmpfs: pathlib.Path) -> None:
    ckdir = small_tmpfs / "ckpt"
    first = save(state_of(1, mib=0.5), ckdir, step=1, environ=JOB)
    with pytest.raises(StorageError, match="no space left on device") as info:
        save(state_of(2, mib=4), ckdir, step=2, environ=JOB)
    assert info.value.errno == errno.ENOSPC and str(ckdir) in str(info.value)
    assert [p.name for p in ckdir.iterdir() if p.name != LEASE_NAME] == [pathlib.Path(first).name]
    ck = load_latest(ckdir)
    assert ck.path == first
    assert_state(ck.state, 1, mib=0.5)


def test_enospc_in_a_background_save_is_raised_next(small_tmpfs: pathlib.Path) -> None:
    ckdir = small_tmpfs / "ckpt"
    with Checkpointer(ckdir, environ=JOB) as saver:
        saver.save(state_of(1, mib=0.5), step=1)
        saver.wait()
        saver.save(state_of(2, mib=4), step=2)
        with pytest.raises(CheckpointError, match="no space left") as info:
            saver.wait()
        assert isinstance(info.value.__cause__, StorageError)
    assert load_latest(ckdir).step == 1
    assert len([p for p in ckdir.iterdir() if p.name != LEASE_NAME]) == 1
