"""Paths given to the public entry points: a value that is no path (arguments swapped, a
dict where the directory goes), an empty one or one with a NUL is refused in one line that
names the argument, before anything is created."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

import pytest

from shardio import ShardDataset, ShardWriter
from shardio._check import require_path
from shardio.checkpoint import Checkpointer, load_latest, save
from shardio.errors import UsageError

_CALLS: dict[str, Callable[[Any], Any]] = {
    "save": lambda d: save({"w": 1}, d, step=1),
    "load_latest": load_latest,
    "Checkpointer": Checkpointer,
    "ShardWriter": ShardWriter,
    "ShardDataset": ShardDataset,
}


@pytest.mark.parametrize("call", sorted(_CALLS))
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"model": 1}, "must be a path .* got dict"),
        (None, "must be a path .* got NoneType"),
        (b"ckpt", "must be a path .* got bytes"),
        (7, "must be a path .* got int"),
        ("", "must not be empty"),
        ("ck\0pt", "has a NUL character"),
    ],
)
def test_not_a_path_is_refused_in_one_line(
    call: str, value: Any, message: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=message) as info:
        _CALLS[call](value)
    assert "\n" not in str(info.value)
    assert os.listdir(tmp_path) == []


def test_a_pathlike_is_a_path(tmp_path: pathlib.Path) -> None:
    assert require_path(tmp_path / "x", "dir") == str(tmp_path / "x")
    assert require_path("rel/x", "dir") == "rel/x"
