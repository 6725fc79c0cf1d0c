"""Every Python block of the docs runs, each in a fresh interpreter, so no example can rot."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ["docs/architecture.md"]
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def _blocks() -> list[tuple[str, int, str]]:
    found = []
    for name in DOCS:
        text = (ROOT / name).read_text(encoding="utf-8")
        for number, match in enumerate(_BLOCK.finditer(text), start=1):
            found.append((name, number, match.group(1)))
    return found


def test_each_listed_page_has_examples() -> None:
    pages = {name for name, _, _ in _blocks()}
    assert pages == set(DOCS)


@pytest.mark.parametrize(
    ("page", "number", "code"),
    [pytest.param(*block, id=f"{block[0]}:{block[1]}") for block in _blocks()],
)
def test_example_runs(page: str, number: int, code: str, tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONWARNINGS": "error::DeprecationWarning"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"{page} block {number} failed:\n{result.stderr[-3000:]}"
