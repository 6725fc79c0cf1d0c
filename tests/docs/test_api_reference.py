"""The API reference (docs/reference/api.md, rendered from the docstrings) lists the whole
public surface: every name of ``shardio`` and of each public sub-package face."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "reference" / "api.md"
FACES = [
    "shardio",
    "shardio.checkpoint",
    "shardio.dali",
    "shardio.metrics",
    "shardio.staging",
    "shardio.read.faults",
]


@pytest.mark.parametrize("face", FACES)
def test_every_public_name_is_in_the_reference(face: str) -> None:
    listed = set(re.findall(r"^::: shardio\.[\w.]*?\.?(\w+)$", PAGE.read_text(), re.M))
    names = set(importlib.import_module(face).__all__) - {"__version__"}
    assert names - listed == set(), f"{face}: missing from {PAGE.name}"


def test_each_entry_names_an_object_that_exists() -> None:
    for path in re.findall(r"^::: (shardio[\w.]+)$", PAGE.read_text(), re.M):
        module, _, name = path.rpartition(".")
        assert hasattr(importlib.import_module(module), name), path
