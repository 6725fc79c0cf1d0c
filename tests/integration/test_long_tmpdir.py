"""A job's TMPDIR may be long (a scheduler's per-job path): pack and verify still start their
worker pools, whose forkserver needs a socket path of at most 107 bytes."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from trees import write_tree


def test_pack_and_verify_run_under_a_tmpdir_too_long_for_a_socket(tmp_path: pathlib.Path) -> None:
    tmpdir = tmp_path / ("t" * (120 - len(str(tmp_path))))
    tmpdir.mkdir()
    assert len(str(tmpdir)) >= 110
    src = tmp_path / "src"
    write_tree(src, {f"train/c{i % 2}/{i}.jpg".encode(): os.urandom(3000) for i in range(12)})
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    for args in (["pack", str(src), str(tmp_path / "out"), "--shard-size", "8KiB", "--workers",
                  "2", "--no-progress"], ["verify", str(tmp_path / "out"), "--workers", "2",
                  "--no-progress"]):  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "shardio", *args],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "AF_UNIX" not in done.stderr
    assert list(tmpdir.iterdir()) == []  # nothing left in TMPDIR
