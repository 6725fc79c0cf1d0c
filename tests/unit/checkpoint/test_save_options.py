"""Every option of save and Checkpointer is checked by type: one line naming it."""

from __future__ import annotations

import pathlib

import pytest
import torch
from checkpointing import JOB

from shardio.checkpoint import Checkpointer, SaveOptions, save
from shardio.errors import UsageError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"per_rank": "no"}, "per_rank must be True or False, got str 'no'"),
        ({"per_rank": 0}, "per_rank must be True or False"),
        ({"reuse_buffers": "yes"}, "reuse_buffers must be True or False"),
        ({"environ": {"SLURM_JOB_ID": 5}}, "environ['SLURM_JOB_ID'] is int 5"),
        ({"environ": "SLURM_JOB_ID=5"}, "environ must be a mapping of str to str"),
        ({"clock": 5}, "clock must be a function returning seconds"),
        ({"loader": object()}, "loader object has no state_dict()"),
        ({"options": "fast"}, "options must be a SaveOptions, not str"),
        ({"runner": "lfs"}, "runner must be callable"),
        ({"verify": "no"}, "verify must be True or False"),
    ],
)
def test_a_wrong_checkpointer_option_is_named(
    ckdir: pathlib.Path, kwargs: dict, message: str
) -> None:
    kwargs = {"environ": JOB, **kwargs}
    with pytest.raises(UsageError) as info:
        Checkpointer(ckdir, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not ckdir.exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"per_rank": "no"}, "per_rank must be True or False, got str 'no'"),
        ({"environ": {"SLURM_JOB_ID": 5}}, "environ['SLURM_JOB_ID'] is int 5"),
        (
            {"environ": ["SLURM_JOB_ID"]},
            "environ must be a mapping of str to str (like os.environ), not list",
        ),
        ({"options": {"level": 3}}, "options must be a SaveOptions, not dict"),
        ({"runner": None}, "runner must be callable"),
    ],
)
def test_a_wrong_save_option_is_named(ckdir: pathlib.Path, kwargs: dict, message: str) -> None:
    kwargs = {"environ": JOB, **kwargs}
    with pytest.raises(UsageError) as info:
        save({"w": torch.ones(2)}, ckdir, step=1, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not list(ckdir.glob("*checkpoint*"))


def test_a_clock_that_returns_no_number_is_named(ckdir: pathlib.Path) -> None:
    with Checkpointer(ckdir, environ=JOB, clock=lambda: "noon") as saver:  # type: ignore[arg-type,return-value]
        with pytest.raises(UsageError, match=r"clock\(\) must return seconds .* not 'noon'"):
            saver.maybe_save(1, full=dict)
        with pytest.raises(UsageError, match="full= and light= must be functions"):
            saver.maybe_save(1, full={"w": 1})  # type: ignore[arg-type]
        saver.save({"w": 1}, step=1)  # explicit saves need no clock reading


def test_save_options_take_a_real_runner() -> None:
    assert SaveOptions(runner=lambda argv, **kw: None).runner is not None
    with pytest.raises(UsageError, match="runner must be callable"):
        SaveOptions(runner="lfs")  # type: ignore[arg-type]
