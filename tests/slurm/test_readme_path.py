"""The README's "From nothing to a SLURM job" lines, run as they stand on the real cluster.

The block is taken from README.md and run by bash in a directory that looks like a checkout
(``scripts/``, ``examples/`` and ``.venv`` linked to this one's, the Makefile and
pyproject.toml copied with their times, so ``make install`` finds the install done), with the
cluster's SLURM_CONF and a node-local TMPDIR, as a login shell on a cluster has them. It
packs, stages, trains two ranks, checkpoints, and a second job resumes from the first one's
newest checkpoint.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import pytest
from slurmbed import Cluster

REPO = pathlib.Path(__file__).resolve().parents[2]


def readme_block() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## From nothing to a SLURM job", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match is not None, "the README lost its SLURM path"
    return match.group(1)


def test_the_block_is_short() -> None:
    lines = [line for line in readme_block().splitlines() if line.strip()]
    assert len(lines) <= 15, lines


def test_readme_path_packs_stages_trains_and_resumes(
    slurm_cluster: Cluster, tmp_path: pathlib.Path
) -> None:
    uptodate = subprocess.run(
        ["make", "-q", "-C", str(REPO), "install"], capture_output=True, timeout=60, check=False
    )
    if uptodate.returncode != 0:
        pytest.fail("`make install` is not up to date in this checkout: run it first")
    home = tmp_path / "checkout"
    home.mkdir()
    for name in ("scripts", "examples", ".venv"):
        (home / name).symlink_to(REPO / name)
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy2(REPO / name, home / name)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    script = tmp_path / "path.sh"
    script.write_text("set -euo pipefail\n" + readme_block())
    proc = slurm_cluster.run(
        ["bash", str(script)], cwd=home, env={"TMPDIR": str(nvme)}, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = sorted(home.glob("shardio-train-*.out"))
    assert len(logs) == 2, logs
    first, second = (p.read_text() for p in logs)
    assert first.count("no checkpoint: a fresh start") == 2  # both ranks
    assert first.count("done: 30 steps") == 2
    assert second.count("resumed from") == 2
    assert "(step 29)" in second
    assert second.count("done: 60 steps") == 2
    # (and the directory's lease, .shardio-owner, that the second job took over)
    ckpts = sorted(p.name for p in (home / "demo-ckpt").iterdir() if p.name != ".shardio-owner")
    assert ckpts and all(re.match(r"^checkpoint_.+_full_step\d{15}$", n) for n in ckpts), ckpts
    assert ckpts[-1].endswith("step000000000000059")
    assert "checkpoint_" in proc.stdout  # the `ls` line printed them
    # the staged copies were removed at the end of each job
    assert [p for p in nvme.rglob("*") if p.is_file()] == []
    verify = subprocess.run(
        [str(REPO / ".venv" / "bin" / "shardio"), "verify", str(home / "demo-ds")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stderr
    assert os.path.isdir(home / "demo-tree")
