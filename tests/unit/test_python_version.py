"""The Python versions shardio declares are the ones its checks run on: requires-python,
the classifiers, ruff's and mypy's target and the interpreter running this suite agree
(a declared 3.10 that nothing tested let ``datetime.UTC`` through)."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_declared_minimum_is_the_checked_one() -> None:
    doc = tomllib.loads(PYPROJECT.read_text())
    spec = doc["project"]["requires-python"]
    match = re.fullmatch(r">=3\.(\d+)", spec)
    assert match, spec
    minimum = (3, int(match.group(1)))
    assert sys.version_info[:2] >= minimum
    assert doc["tool"]["ruff"]["target-version"] == f"py3{minimum[1]}"
    assert doc["tool"]["mypy"]["python_version"] == f"3.{minimum[1]}"
    versions = [
        (3, int(c.rsplit(".", 1)[1]))
        for c in doc["project"]["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    assert versions and min(versions) == minimum, versions  # none below the minimum
    assert sys.version_info[:2] in versions  # the one this suite runs on is declared
