"""SHARDIO_PFS=required: a run that collected pfs tests fails unless every one of them ran.

The hook lives in tests/conftest.py; it is exercised here on a throwaway tree holding a copy
of that conftest and of tests/pfs/conftest.py (which marks its tests ``pfs``), run by a pytest
subprocess, so the checks do not need the MooseFS bed.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parents[1]

PFS_TESTS = """
import os
import pytest

def test_runs():
    pass

def test_may_skip():
    if os.environ.get("FORCE_SKIP"):
        pytest.skip("forced skip")

@pytest.mark.xfail(reason="an expected failure runs")
def test_expected_failure():
    assert False
"""


@pytest.fixture
def tree(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "t"
    (root / "pfs").mkdir(parents=True)
    shutil.copy(TESTS / "conftest.py", root / "conftest.py")
    shutil.copy(TESTS / "pfs" / "conftest.py", root / "pfs" / "conftest.py")
    (root / "pfs" / "test_on_bed.py").write_text(PFS_TESTS)
    (root / "test_plain.py").write_text("def test_plain():\n    pass\n")
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    pfs: on the bed\n")
    return root


def _pytest(root: pathlib.Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in {"SHARDIO_PFS", "FORCE_SKIP"}}
    environ.update(env, PYTHONPATH=str(TESTS))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=root, env=environ, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_skipped_pfs_test_fails_a_required_run(tree: pathlib.Path) -> None:
    proc = _pytest(tree, SHARDIO_PFS="required", FORCE_SKIP="1")
    assert proc.returncode == 1, proc.stdout
    assert "SHARDIO_PFS=required: 1 pfs test(s) skipped" in proc.stdout
    assert "test_may_skip" in proc.stdout


def test_a_required_run_where_every_pfs_test_ran_passes(tree: pathlib.Path) -> None:
    proc = _pytest(tree, SHARDIO_PFS="required")
    assert proc.returncode == 0, proc.stdout
    assert "SHARDIO_PFS=required" not in proc.stdout
    assert "3 passed, 1 xfailed" in proc.stdout


def test_the_skip_is_allowed_without_required(tree: pathlib.Path) -> None:
    proc = _pytest(tree, FORCE_SKIP="1")
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("selection", [["-k", "plain"], ["-m", "not pfs"], ["test_plain.py"]])
def test_a_selection_without_pfs_tests_is_not_held_to_it(
    tree: pathlib.Path, selection: list[str]
) -> None:
    proc = _pytest(tree, *selection, SHARDIO_PFS="required", FORCE_SKIP="1")
    assert proc.returncode == 0, proc.stdout
    assert "1 passed" in proc.stdout


def test_collect_only_is_not_held_to_it(tree: pathlib.Path) -> None:
    proc = _pytest(tree, "--collect-only", SHARDIO_PFS="required", FORCE_SKIP="1")
    assert proc.returncode == 0, proc.stdout
