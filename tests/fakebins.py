"""The recording fakes of tools that cannot run here: one folder per tool in tests/fakebin.

``lfs`` and ``beegfs-ctl`` (no Lustre or BeeGFS), ``beeond``, ``srun``, ``scontrol``,
``numactl`` and ``taskset`` (no BeeOND, SLURM daemons or NUMA hardware for the job scripts).
Each fake appends its argv (command name first, tab-separated, one call a line) to
``$SHARDIO_FAKE_LOG``; a test puts the folders of the tools it fakes, and only those, first
on ``PATH`` with :func:`fake_path`.
"""

from __future__ import annotations

import os
import pathlib

FAKEBIN = pathlib.Path(__file__).resolve().parent / "fakebin"
TOOLS = ("beegfs-ctl", "beeond", "lfs", "numactl", "scontrol", "srun", "taskset")
# What the job scripts under scripts/slurm and scripts/beeond call.
JOB_TOOLS = ("srun", "scontrol", "beeond", "numactl", "taskset")


def fake_path(*tools: str) -> str:
    """The ``PATH`` entries that put these tools' fakes first (``os.pathsep``-joined)."""
    unknown = sorted(set(tools) - set(TOOLS))
    if unknown:
        raise ValueError(f"no fake for {unknown}: the fakes are {TOOLS}")
    return os.pathsep.join(str(FAKEBIN / tool) for tool in tools)


def fake_files() -> list[pathlib.Path]:
    """Every fake and the helper they source (for shellcheck and ``bash -n``)."""
    return sorted(p for p in FAKEBIN.rglob("*") if p.is_file())


def read_calls(log: pathlib.Path) -> list[list[str]]:
    """The fakes' calls recorded in ``log`` so far: one list per call, command name first."""
    if not log.exists():
        return []
    return [line.split("\t") for line in log.read_text(encoding="utf-8").splitlines()]
