"""The pages marked ``<!-- test-page: needs=slurm -->``, run on the real one-host cluster.

Each page's blocks run in order (tests/mdblocks.py) in a directory that looks like a checkout,
with the cluster's environment (its SLURM_CONF, so ``sbatch``, ``srun`` and ``sinfo`` reach it)
and a node-local ``TMPDIR``, as a login shell on a cluster has them. Then the page's own checks
look at what its blocks left: for docs/guides/staging-slurm.md, whose opening example packs,
stages, trains two ranks, checkpoints, and resumes in a second job, the two job logs, the
resumed step, the checkpoints and the staged copies removed.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
from collections.abc import Callable

import mdblocks
import pytest
from slurmbed import Cluster

REPO = mdblocks.REPO
STAGING = "docs/guides/staging-slurm.md"


def _needs_slurm(name: str) -> bool:
    try:
        return "slurm" in mdblocks.parse(name).needs
    except mdblocks.PageError:
        # tests/docs reports every page that does not parse; one meant for the cluster fails
        # here too, when its test parses it
        return "needs=slurm" in (REPO / name).read_text(encoding="utf-8")


PAGES = [name for name in mdblocks.pages() if _needs_slurm(name)]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return mdblocks.make_data(tmp_path_factory.mktemp("docs-slurm-data"))


def check_staging(home: pathlib.Path, nvme: pathlib.Path) -> None:
    """What the staging guide's blocks leave: its opening example's two jobs (the second
    resumed from the first one's last checkpoint), and no staged copy on the node's disk."""
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
    # every staged copy was removed: by each job's epilogue, by the page's --clean lines, by
    # BeeOND's stop (the fake deletes its mount, as `beeond stop -d` deletes the data)
    assert [p for p in nvme.rglob("*") if p.is_file()] == []
    verify = subprocess.run(
        [str(REPO / ".venv" / "bin" / "shardio"), "verify", str(home / "demo-ds")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stderr
    assert (home / "demo-tree").is_dir()


CHECKS: dict[str, Callable[[pathlib.Path, pathlib.Path], None]] = {STAGING: check_staging}


def test_the_staging_guide_runs_here() -> None:
    assert STAGING in PAGES, f"{STAGING} lost its test-page: needs=slurm"


def test_the_opening_example_is_short() -> None:
    """The guide's first block, from nothing to a SLURM job, fits on a screen."""
    first = mdblocks.parse(STAGING).blocks[0]
    lines = [line for line in first.code.splitlines() if line.strip()]
    assert first.lang == "sh" and "sbatch" in first.code, first.where
    assert len(lines) <= 15, lines


@pytest.mark.parametrize("page", PAGES)
def test_page_runs_on_the_cluster(
    page: str, slurm_cluster: Cluster, data: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    # A page may run `make install`: in a checkout whose install is stale, that would
    # pip-install into this checkout's venv from the page's directory.
    uptodate = subprocess.run(
        ["make", "-q", "-C", str(REPO), "install"], capture_output=True, timeout=60, check=False
    )
    if uptodate.returncode != 0:
        pytest.fail("`make install` is not up to date in this checkout: run it first")
    nvme = tmp_path / "nvme"  # the node-local disk
    nvme.mkdir()
    env = slurm_cluster.env(
        {"TMPDIR": str(nvme), "SHARDIO_FAKE_BEEOND_MOUNT": str(nvme / "beeond")}
    )
    home = mdblocks.run_page(mdblocks.parse(page), tmp_path, data, extra_env=env)
    CHECKS.get(page, lambda home, nvme: None)(home, nvme)
