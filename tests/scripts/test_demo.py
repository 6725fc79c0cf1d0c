"""`make demo` ends by training: scripts/demo.py, small, packs, verifies, reads back, trains a
few steps through ds.loader(...) and prints the loader's figures and where to go next."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytest.importorskip("torch")
pytest.importorskip("PIL")


def test_the_demo_packs_reads_and_trains(tmp_path: pathlib.Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--dir", str(tmp_path), "--files",
         "200", "--steps", "2"],
        capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "$ shardio verify" in out and "read back 200 samples" in out
    assert re.search(r"^trained 2 steps of 64 \(loss \d+\.\d\d -> \d+\.\d\d", out, re.M), out
    assert "resume after 128 samples" in out
    assert re.search(r"^loader: rank 0/1 \| .* samples/s", out, re.M), out
    assert "next: the guides of the docs site" in out
    assert (tmp_path / "packed" / "manifest.json").is_file()
