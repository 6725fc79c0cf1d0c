"""The suite's plugin (tests/suite_plugin.py), on a throwaway tree holding a copy of
tests/conftest.py (which loads the plugin) and of tests/pfs/conftest.py (which marks its tests
``pfs``), run by a pytest subprocess, plain and under pytest-xdist, so the checks do not need
the MooseFS bed:

- SHARDIO_PFS=required: a run that collected pfs tests fails unless every one of them ran;
- the fast selection derived from the tree's tests/durations.json;
- the progress lines and the run's report (SHARDIO_TEST_PROGRESS, SHARDIO_TEST_REPORT).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parents[1]
XDIST = ["-n", "2"]

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
    environ = {
        k: v
        for k, v in os.environ.items()
        if k not in {"SHARDIO_PFS", "FORCE_SKIP"} and not k.startswith("SHARDIO_TEST_")
    }
    environ.update(env, PYTHONPATH=str(TESTS))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=root, env=environ, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("workers", [[], XDIST], ids=["plain", "xdist"])
def test_a_skipped_pfs_test_fails_a_required_run(tree: pathlib.Path, workers: list[str]) -> None:
    proc = _pytest(tree, *workers, SHARDIO_PFS="required", FORCE_SKIP="1")
    assert proc.returncode == 1, proc.stdout
    assert "SHARDIO_PFS=required: 1 pfs test(s) skipped" in proc.stdout
    assert "test_may_skip" in proc.stdout


@pytest.mark.parametrize("workers", [[], XDIST], ids=["plain", "xdist"])
def test_a_required_run_where_every_pfs_test_ran_passes(
    tree: pathlib.Path, workers: list[str]
) -> None:
    proc = _pytest(tree, *workers, SHARDIO_PFS="required")
    assert proc.returncode == 0, proc.stdout
    assert "SHARDIO_PFS=required" not in proc.stdout
    assert "3 passed, 1 xfailed" in proc.stdout
    assert "pfs        3 ran, 0 skipped, 0 deselected" in proc.stdout


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


@pytest.mark.parametrize("workers", [[], XDIST], ids=["plain", "xdist"])
def test_deselected_tests_of_a_group_are_counted(tree: pathlib.Path, workers: list[str]) -> None:
    report = tree / "report.json"
    proc = _pytest(tree, *workers, "-m", "not pfs", SHARDIO_TEST_REPORT=str(report))
    assert proc.returncode == 0, proc.stdout
    assert "pfs        0 ran, 0 skipped, 3 deselected" in proc.stdout
    assert json.loads(report.read_text())["deselected"] == 3


# --------------------------------------------------------------------------- fast selection
QUICK_TESTS = """
import time
import pytest

@pytest.fixture(scope="module")
def costly():
    time.sleep(0.01)

def test_quick():
    pass

def test_slow():
    pass

def test_new():
    pass

def test_shares(costly):
    pass
"""


def _selected(tree: pathlib.Path, *args: str) -> set[str]:
    proc = _pytest(tree, "--collect-only", "-m", "not slow", *args)
    assert proc.returncode in (0, 5), proc.stdout
    return {line.split("::")[-1] for line in proc.stdout.splitlines() if "::" in line}


def test_the_fast_selection_is_what_the_record_says_is_fast(tree: pathlib.Path) -> None:
    (tree / "test_quick.py").write_text(QUICK_TESTS)
    (tree / "test_costly.py").write_text(QUICK_TESTS)
    (tree / "tests").mkdir()
    record = {
        "shared": {"test_costly.py": 3.0},
        "tests": {
            "test_quick.py": {"test_quick": 0.01, "test_slow": 4.0, "test_shares": 0.01},
            "test_costly.py": {"test_quick": 0.01, "test_shares": 0.01},
        },
    }
    (tree / "tests" / "durations.json").write_text(json.dumps(record))
    # test_new is not recorded: out until a record says it is fast; test_costly.py's tests
    # are each quick, but whichever runs first pays its 3 s module fixture.
    assert _selected(tree, "test_quick.py", "test_costly.py") == {"test_quick", "test_shares"}
    # Without a record nothing is fast.
    (tree / "tests" / "durations.json").unlink()
    assert _selected(tree, "test_quick.py") == set()


@pytest.mark.parametrize("text", ["{not json", '{"tests": []}', '{"tests": {"m.py": {"t": "x"}}}'])
def test_a_damaged_record_is_one_clear_line(tree: pathlib.Path, text: str) -> None:
    (tree / "tests").mkdir()
    (tree / "tests" / "durations.json").write_text(text)
    proc = _pytest(tree, "--collect-only")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if "durations.json" in ln]
    assert "not a durations record" in line and "make test-durations" in line


# --------------------------------------------------------------------------- progress, report
PROGRESS_TESTS = """
import time
import pytest

@pytest.fixture(scope="module")
def shared():
    time.sleep(0.3)

def test_ok(shared):
    pass

def test_also(shared):
    pass

def test_broken():
    assert False

def test_skipped():
    pytest.skip("not here")
"""


@pytest.mark.parametrize("workers", [[], XDIST], ids=["plain", "xdist"])
def test_progress_lines_replace_the_dots_and_the_report_holds_each_test(
    tree: pathlib.Path, workers: list[str]
) -> None:
    (tree / "test_progress.py").write_text(PROGRESS_TESTS)
    report = tree / "report.json"
    proc = _pytest(
        tree, *workers, "-p", "no:randomly",
        SHARDIO_TEST_PROGRESS="demo", SHARDIO_TEST_REPORT=str(report),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout
    lines = proc.stdout.splitlines()
    failed = [line for line in lines if line.startswith("[demo ") and "FAILED" in line]
    assert len(failed) == 1 and failed[0].endswith("FAILED test_progress.py::test_broken")
    dots = re.compile(r"[.FEsxX]+ *(\[ *\d+%\])?")
    assert not any(dots.fullmatch(line) for line in lines), proc.stdout
    data = json.loads(report.read_text())
    tests = data["tests"]
    assert tests["test_progress.py::test_broken"][1] == "failed"
    assert tests["test_progress.py::test_skipped"][1] == "skipped"
    assert tests["pfs/test_on_bed.py::test_expected_failure"][1] == "xfailed"
    assert tests["test_plain.py::test_plain"][1] == "passed"
    # The module fixture's 0.3 s is the module's, counted on whichever test set it up: one
    # of the two, or (xdist's worksteal may give them to two workers) each, once per worker.
    shared = [tests[f"test_progress.py::{n}"][2] for n in ("test_ok", "test_also")]
    setups = [t for t in shared if t >= 0.25]
    assert setups and all(t == 0.0 or t >= 0.25 for t in shared), shared
    assert len(setups) == 1 or workers, shared  # one process: set up once
    # Every fixture broader than a test: times set up and seconds (under xdist from each worker).
    count, seconds = data["fixtures"]["module shared"]
    assert count == len(setups) and seconds >= 0.25 * count
    assert data["groups"]["pfs"]["ran"] == 3
    assert data["exitstatus"] == 1
    assert data["deselected"] == 0
