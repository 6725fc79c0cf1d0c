"""load_latest's arguments, each checked by type and refused in one line naming it (issue 32)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from checkpointing import JOB, assert_state, state_of

from shardio.checkpoint import load_latest, save
from shardio.errors import UsageError


class _PositionOnly:
    """A loader that can say its state but not take one back."""

    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "consumed": 3}


class _Resumable(_PositionOnly):
    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = state


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("weights_only", "no", "weights_only must be True or False, got str 'no'"),
        ("weights_only", 0, "weights_only must be True or False, got int 0"),
        ("weights_only", None, "weights_only must be True or False, got NoneType"),
        ("loader", object(), "loader must have load_state_dict() .*got object"),
        ("loader", _PositionOnly(), "loader must have load_state_dict() .*got _PositionOnly"),
        ("loader", _Resumable, "loader must have load_state_dict() .*got type"),
        ("map_location", 3, "map_location must be a device name .*got int 3"),
        ("map_location", {"cpu": 1}, "map_location must be a device name .*got dict"),
        ("read_timeout_s", "10", "read_timeout_s must be a number of seconds"),
        ("read_timeout_s", float("nan"), "read_timeout_s must be seconds, more than 0"),
        ("kind", 1, "checkpoint kind must be 'full' or 'light', not 1"),
        ("environ", ["SLURM_JOB_ID"], "environ must be a mapping of str to str"),
        ("environ", {"SLURM_JOB_ID": 7}, r"environ\['SLURM_JOB_ID'\] is int 7"),
    ],
)
def test_a_bad_option_is_refused_in_one_line_naming_it(
    ckdir: pathlib.Path, option: str, value: Any, says: str
) -> None:
    save(state_of(1), ckdir, step=1, environ=JOB)
    kwargs: dict[str, Any] = {"environ": JOB, option: value}
    with pytest.raises(UsageError, match=says.replace("()", r"\(\)")) as info:
        load_latest(ckdir, **kwargs)
    assert "\n" not in str(info.value)


def test_good_options_of_every_accepted_type_load(ckdir: pathlib.Path) -> None:
    save(state_of(1), ckdir, step=1, environ=JOB)
    for where in ("cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda storage, loc: storage, None):
        ck = load_latest(ckdir, map_location=where, weights_only=True, environ=JOB)
        assert_state(ck.state, 1)
    import numpy as np

    assert load_latest(ckdir, weights_only=np.bool_(True), read_timeout_s=5, environ=JOB).step == 1
