"""Packing runs on login nodes without GPUs: the pack path never imports torch or DALI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_pack_verify_unpack_import_neither_torch_nor_dali(tmp_path: Path) -> None:
    src = tmp_path / "src" / "cat"
    src.mkdir(parents=True)
    (src / "a.txt").write_bytes(b"hello")
    (src / "b.txt").write_bytes(b"world")
    script = f"""
import sys
from shardio import pack, PackOptions, verify_dataset, unpack_dataset, ShardReader
from shardio.cli.main import main
pack({str(tmp_path / "src")!r}, {str(tmp_path / "out")!r}, PackOptions(workers=1))
assert verify_dataset({str(tmp_path / "out")!r}).ok
unpack_dataset({str(tmp_path / "out")!r}, {str(tmp_path / "back")!r})
with ShardReader({str(tmp_path / "out")!r}) as ds:
    ds.read_sample(0)
assert main(["inspect", {str(tmp_path / "out")!r}]) == 0
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "nvidia", "webdataset"))
print("IMPORTED", bad)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert "IMPORTED []" in out


def test_stage_start_up_defers_numpy() -> None:
    """A job prologue starts `shardio stage` cold: its imports leave numpy (about half of a
    cold start) to the thread that computes the order beside the index copy."""
    script = """
import sys
import shardio.cli.main, shardio.staging
print("NUMPY", "numpy" in sys.modules)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert "NUMPY False" in out
