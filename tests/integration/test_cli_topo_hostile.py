"""A hostile sysfs tree (``shardio topo --sysfs``, ``SHARDIO_SYSFS``) never hangs.

A FIFO in place of a cpulist once blocked ``shardio topo`` (and every loader that pins its
workers) forever; a symlink to ``/dev/zero`` was read until memory ran out. Each run here
has a timeout, so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from fakesysfs import fake_sysfs, plant

TIMEOUT_S = 30.0
FILES = [
    "devices/system/node/node0/cpulist",
    "bus/pci/devices/0000:07:00.0/numa_node",
    "bus/pci/devices/0000:07:00.0/vendor",
    "devices/system/cpu/cpu0/topology/thread_siblings_list",
]


def tree(tmp_path: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(fake_sysfs(tmp_path / "sys", {0: "0-1"}, [0], siblings={0: "0", 1: "1"}))


@pytest.mark.parametrize("kind", ["fifo", "devzero", "big"])
@pytest.mark.parametrize("rel", FILES)
def test_topo_refuses_a_non_regular_or_huge_sysfs_file_in_one_line(
    run_cli: Callable[..., Any],
    assert_cli_error: Callable[..., str],
    tmp_path: pathlib.Path,
    rel: str,
    kind: str,
) -> None:
    root = tree(tmp_path)
    plant(root, rel, kind)
    result = run_cli("topo", "--sysfs", root, "--json", timeout=TIMEOUT_S)
    reason = "more than the 65,536" if kind == "big" else "not a regular file"
    assert_cli_error(result, str(root / rel), reason)
    assert result.rc == 1


def test_a_symlinked_regular_file_is_read(
    run_cli: Callable[..., Any], tmp_path: pathlib.Path
) -> None:
    # A fake tree made with `cp -rs`: symlinks to regular files are fine.
    root = tree(tmp_path)
    real = tmp_path / "cpulist"
    real.write_text("0-1\n")
    link = root / "devices/system/node/node0/cpulist"
    link.unlink()
    link.symlink_to(real)
    result = run_cli("topo", "--sysfs", root, timeout=TIMEOUT_S)
    assert result.rc == 0, result.stderr
    assert "NUMA node 0   CPUs 0-1" in result.stdout


@pytest.mark.parametrize("kind", ["fifo", "devzero"])
def test_loader_pinning_gives_up_in_bounded_time(tmp_path: pathlib.Path, kind: str) -> None:
    root = tree(tmp_path)
    plant(root, FILES[0], kind)
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.DEBUG, stream=sys.stdout)\n"
        "from shardio.runtime.placement import worker_pinning\n"
        "env = {'SHARDIO_SYSFS': sys.argv[1]}\n"
        "pin = worker_pinning(num_workers=2, local_rank=0, environ=env)\n"
        "print('pinning', pin)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(root)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "pinning None" in proc.stdout  # best effort: no placement, workers unpinned
    assert "not a regular file" in proc.stdout  # said at debug level
