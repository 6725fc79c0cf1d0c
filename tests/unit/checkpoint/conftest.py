"""The checkpoint tests' directory fixture."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture
def ckdir(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "ckpt"
