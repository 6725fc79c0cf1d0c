"""``shardio topo``'s job sizing section, on fake sysfs, cgroup and procfs trees."""

from __future__ import annotations

import json
import os
import pathlib
import re

import pytest
from fakesysfs import fake_cgroup, fake_sysfs, plant

from shardio.cli.main import main

CPUS = os.sched_getaffinity(0)
MASK = ",".join(str(c) for c in sorted(CPUS)) if len(CPUS) < 3 else None


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "SHARDIO_SYSFS", "SHARDIO_PROCFS"):
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def box(tmp_path: pathlib.Path) -> tuple[str, str]:
    """(sysfs, procfs): 8 GPUs over 2 NUMA nodes (this process may use CPUs 0-1 of node 0)
    in a cgroup capped at 1 CPU."""
    sysfs = fake_sysfs(tmp_path / "sys", {0: "0-31", 1: "32-63"}, [0, 0, 0, 0, 1, 1, 1, 1])
    fake_cgroup(tmp_path / "sys", tmp_path / "proc", {"job/step/cpu.max": "100000 100000"})
    return sysfs, str(tmp_path / "proc")


def topo(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["topo", *args]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


@pytest.mark.skipif(not {0, 1} <= CPUS, reason="the fake box needs CPUs 0 and 1")
def test_section_names_each_source_and_the_room(
    box: tuple[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sysfs, procfs = box
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")
    out = topo(capsys, "--sysfs", sysfs, "--procfs", procfs, "--local-rank", "5", "--workers", "4")
    section = out[out.index("job sizing\n") :].splitlines()
    quota = f"{sysfs}/fs/cgroup/job/step/cpu.max"
    assert section[1:5] == [
        f"  affinity             {'0-1' if len(CPUS) == 2 else section[1].split()[1]} "
        f"({len(CPUS)})",
        f"  cgroup CPU quota     1 (100000/100000 in {quota})",
        "  SLURM_CPUS_PER_TASK  4",
        "  usable CPUs          1: room for the main process and 0 DataLoader workers",
    ]
    assert "  local rank 5         1 CPU placed: room for the main process and 0 DataLoader " \
        "workers" in section  # fmt: skip
    warnings = [line for line in section if line.startswith("  warning: ")]
    assert len(warnings) == 2, section
    assert warnings[0].startswith(
        "  warning: 4 DataLoader workers and the main process share 1 CPU (cgroup CPU quota "
        f"100000/100000 in {quota}, affinity "
    )
    assert warnings[1].startswith("  warning: local rank 5: GPU 5 is on NUMA node 1 but this ")


def test_json_keeps_placements_last_and_flat(
    box: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs, procfs = box
    out = topo(capsys, "--json", "--sysfs", sysfs, "--procfs", procfs, "--local-rank", "0")
    data = json.loads(out)
    sizing = data["job_sizing"]
    assert sizing["cgroup_quota_cpus"] == 1.0
    assert sizing["usable_cpus"] == 1.0 and sizing["slurm_cpus_per_task"] is None
    assert (sizing["workers"], sizing["room_for_workers"], sizing["room"]) == (0, 0, True)
    assert sizing["ranks"] == [{"local_rank": 0, "cpus": 1, "room_for_workers": 0}]
    assert list(data)[-1] == "placements"
    # scripts/slurm/bind.sh reads the first placement with a regular expression, without jq.
    entry = re.search(r'"placements":\s*\[\s*\{([^}]*)\}', out)
    assert entry is not None and '"gpu_index": 0' in entry.group(1)


def test_a_fifo_quota_file_is_a_note_not_an_error(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cgroup(tmp_path / "sys", tmp_path / "proc", {})
    plant(tmp_path / "sys", "fs/cgroup/job/step/cpu.max", "fifo")
    monkeypatch.setenv("SHARDIO_SYSFS", str(tmp_path / "sys"))
    monkeypatch.setenv("SHARDIO_PROCFS", str(tmp_path / "proc"))
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "two")
    out = topo(capsys, "--workers", "1")
    notes = [line for line in out.splitlines() if line.startswith("  note: ")]
    assert len(notes) == 2
    assert notes[0].endswith("cpu.max is a FIFO (named pipe), not a regular file")
    assert notes[1].startswith("  note: SLURM_CPUS_PER_TASK='two' is not a whole number")
    assert "  cgroup CPU quota     none" in out


@pytest.mark.skipif(len(CPUS) < 2, reason="room for a worker needs 2 CPUs")
def test_a_job_with_room_fits(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "proc").mkdir()
    args = ["--sysfs", str(tmp_path), "--procfs", str(tmp_path / "proc")]
    out = topo(capsys, *args, "--workers", str(len(CPUS) - 1))
    assert f"  --workers {len(CPUS) - 1:<10} fits" in out.splitlines()
    assert "warning" not in out
