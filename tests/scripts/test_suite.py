"""The suite's runner (scripts/suite.py: summary, budget, record) and the system packages
script that `make test` and .ci/run run first (scripts/system_packages.sh, against recording
fakes of apt-get, id, locale and localedef: the real ones would install on this machine)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
from types import ModuleType

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGES_SH = REPO / "scripts" / "system_packages.sh"


def _suite() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shardio_suite", REPO / "scripts" / "suite.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def suite(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = _suite()
    monkeypatch.setattr(module, "REPORTS", tmp_path / "reports")
    monkeypatch.setattr(module, "DURATIONS", tmp_path / "tests" / "durations.json")
    monkeypatch.setattr(module, "REPO", tmp_path)
    (tmp_path / "reports" / "last").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    return module


def _report(path: pathlib.Path, tests: dict[str, list[object]], exitstatus: int = 0) -> None:
    path.write_text(
        json.dumps(
            {
                "wall_s": 42.0,
                "exitstatus": exitstatus,
                "collected": len(tests),
                "deselected": 3,
                "groups": {},
                "group_lines": ["  pfs        2 ran, 0 skipped, 0 deselected"],
                "problems": [],
                "tests": tests,
            }
        )
    )


MAIN = {
    "tests/unit/test_a.py::test_quick": [0.01, "passed", 0.0],
    "tests/unit/test_a.py::test_slow": [3.0, "passed", 0.0],
    # the first test of a module with a module-scoped fixture that took 2 s
    "tests/unit/test_b.py::test_first": [2.05, "passed", 2.0],
    "tests/unit/test_b.py::test_second": [0.02, "passed", 0.0],
    "tests/unit/test_c.py::test_broken": [0.5, "failed", 0.0],
}
REAL = {"tests/pfs/test_bed.py::test_on_bed": [30.0, "passed", 0.0]}


def test_record_keeps_each_tests_own_time_and_each_modules_shared_fixtures(
    suite: ModuleType,
) -> None:
    main = {k: v for k, v in MAIN.items() if v[1] == "passed"}
    _report(suite.REPORTS / "last" / "main.json", main)
    _report(suite.REPORTS / "last" / "real.json", REAL)
    real = json.loads((suite.REPORTS / "last" / "real.json").read_text())
    real["fixtures"] = {"session pfs_bed": [2, 6.5], "module tiny": [1, 0.01]}
    (suite.REPORTS / "last" / "real.json").write_text(json.dumps(real))
    assert suite.cmd_record([]) == 0
    data = json.loads(suite.DURATIONS.read_text())
    assert data["fixtures"] == {"real: session pfs_bed": [2, 6.5]}
    assert data["shared"] == {"tests/unit/test_b.py": 2.0}
    assert data["tests"]["tests/unit/test_b.py"] == {"test_first": 0.05, "test_second": 0.02}
    record = suite.Record.load(suite.DURATIONS)
    fast = {n for n in record.own if record.is_fast(n)}
    # test_b's tests are quick alone, but whichever runs first pays the 2 s fixture.
    assert fast == {"tests/unit/test_a.py::test_quick"}


def test_record_refuses_a_run_that_failed_and_writes_nothing(suite: ModuleType) -> None:
    _report(suite.REPORTS / "last" / "main.json", MAIN, exitstatus=1)
    _report(suite.REPORTS / "last" / "real.json", REAL)
    assert suite.cmd_record([]) == 1
    assert not suite.DURATIONS.exists()


def test_record_without_a_run_says_so(
    suite: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert suite.cmd_record([]) == 1
    assert "run make test first" in capsys.readouterr().out


def test_the_summary_prints_groups_the_slowest_tests_the_total_and_the_budget(
    suite: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    suite.DURATIONS.write_text(
        json.dumps({"shared": {}, "tests": {"tests/unit/test_a.py": {"test_quick": 0.01}}})
    )
    main = dict(MAIN)
    main["tests/unit/test_a.py::test_quick"] = [1.5, "passed", 0.0]  # recorded fast, now not
    _report(suite.REPORTS / "last" / "main.json", main)
    _report(suite.REPORTS / "last" / "real.json", REAL)
    missing = suite.summary(["real", "main"], {"real": (0, 800.0), "main": (1, 500.0)}, "test")
    out = capsys.readouterr().out
    assert missing == 0
    lines = out.splitlines()
    assert "main: 1 failed, 4 passed; 3 deselected; wall 8:20" in lines
    assert "  pfs        2 ran, 0 skipped, 0 deselected" in lines
    slowest = lines.index("slowest 6 tests:")
    assert lines[slowest + 1].endswith("tests/pfs/test_bed.py::test_on_bed")
    assert "tests/unit/test_c.py::test_broken (failed)" in out
    assert "total: 6 tests, 37 s of test time, 13:20 wall" in lines
    assert "budget: 13:20 wall, OVER by 1:20: the 12:00 budget" in out
    assert "5 test(s) not in tests/durations.json" in out
    assert "1 test(s) recorded under 0.2 s took 5x that or more here" in out
    assert "test_a.py::test_quick" in out


def test_a_failed_run_ends_with_the_tests_that_did_not_pass(
    suite: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CI log shows its tail: the failures are named last, not only above the summary."""
    real = dict(REAL, **{"tests/pfs/test_bed.py::test_setup": [1.0, "error", 0.0]})
    _report(suite.REPORTS / "last" / "main.json", MAIN, exitstatus=1)
    _report(suite.REPORTS / "last" / "real.json", real, exitstatus=1)
    suite._say_failures(["real", "main"])
    assert capsys.readouterr().out.splitlines() == [
        "not passed (2):",
        "  real: tests/pfs/test_bed.py::test_setup (error)",
        "  main: tests/unit/test_c.py::test_broken (failed)",
    ]


def test_a_run_without_a_report_is_counted(
    suite: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert suite.summary(["main"], {"main": (2, 1.0)}, "fast") == 1
    assert "main: no report" in capsys.readouterr().out


def test_each_run_keeps_its_reports_and_last_names_the_last_to_end(
    suite: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    (suite.REPORTS / "last").rmdir()
    gone = suite.REPORTS / "run-999999999"  # a run whose process is gone
    gone.mkdir()
    (gone / "main.json").write_text("{}")
    running = suite.REPORTS / f"run-{os.getppid()}"  # a run still going
    running.mkdir()
    mine = suite._run_dir()
    assert mine.name == f"run-{os.getpid()}"
    _report(mine / "main.json", MAIN)
    suite._publish(mine)
    assert (suite.REPORTS / "last").resolve() == mine.resolve()
    assert suite._load("main") is not None
    assert not gone.exists() and running.exists()
    # a link planted at a dead run's name is left alone, and so is what it points at
    elsewhere = suite.REPORTS.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "main.json").write_text("{}")
    (elsewhere / "keep.json").write_text("{}")
    (suite.REPORTS / "run-999999998").symlink_to(elsewhere)
    suite._publish(mine)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.json", "main.json"]
    assert (suite.REPORTS / "run-999999998").is_symlink()
    # a report that is not JSON is no report
    (mine / "main.json").write_text("{trunc")
    assert suite._load("main") is None


@pytest.mark.parametrize("raw", ["-1x", "2.5", "many"])
def test_a_bad_worker_count_is_one_line(suite: ModuleType, raw: str) -> None:
    os.environ["SHARDIO_TEST_WORKERS_PROBE"] = raw
    try:
        with pytest.raises(SystemExit, match="SHARDIO_TEST_WORKERS_PROBE must be a whole number"):
            suite._workers(2, "SHARDIO_TEST_WORKERS_PROBE")
    finally:
        del os.environ["SHARDIO_TEST_WORKERS_PROBE"]


def test_worker_counts_are_bounded_and_zero_means_none(
    suite: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARDIO_TEST_WORKERS_PROBE", "0")
    assert suite._workers(2, "SHARDIO_TEST_WORKERS_PROBE") == []
    monkeypatch.setenv("SHARDIO_TEST_WORKERS_PROBE", "100000000000000000000")
    assert suite._workers(2, "SHARDIO_TEST_WORKERS_PROBE")[:2] == ["-n", "64"]
    monkeypatch.delenv("SHARDIO_TEST_WORKERS_PROBE")
    assert suite._workers(3, "SHARDIO_TEST_WORKERS_PROBE")[:2] == ["-n", "3"]


def test_the_command_without_a_subcommand_prints_its_usage() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "suite.py")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "suite.py test [PYTEST_ARGS...]" in proc.stdout


# --------------------------------------------------------------------------- system_packages.sh
_COMMANDS = {
    "strace": "strace", "shellcheck": "shellcheck", "mfsmaster": "moosefs-master",
    "mfschunkserver": "moosefs-chunkserver", "mfsmount": "moosefs-client",
    "mfscli": "moosefs-cli", "fusermount3": "fuse3", "ip": "iproute2", "nsenter": "util-linux",
    "slurmctld": "slurm-wlm", "munged": "munge", "prometheus": "prometheus",
}  # fmt: skip


def _packages_sh(
    tmp_path: pathlib.Path, *, have: set[str], uid: int, locale: str = "en_US.utf8"
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run the script with PATH holding only fakes: ``have`` the commands present."""
    fakes = tmp_path / "bin"
    fakes.mkdir()
    log = tmp_path / "calls.log"

    def fake(name: str, body: str) -> None:
        path = fakes / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)

    for tool in ("grep", "touch"):
        found = shutil.which(tool)
        assert found is not None
        (fakes / tool).symlink_to(found)
    for command in have:
        fake(command, "exit 0")
    record = f'echo "$0 $*" >> "{log}"'
    fake("apt-get", record)
    fake("localedef", record)
    fake("id", f"echo {uid}")
    fake("locale", f"echo C.UTF-8; echo {locale}")
    proc = subprocess.run(
        ["/bin/bash", str(PACKAGES_SH)],
        env={"PATH": str(fakes), "TMPDIR": str(tmp_path)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, [c.replace(str(fakes) + "/", "") for c in calls]


def test_as_root_every_missing_package_is_installed_prometheus_too(tmp_path: pathlib.Path) -> None:
    proc, calls = _packages_sh(tmp_path, have=set(), uid=0)
    assert proc.returncode == 0, proc.stderr
    assert calls[0] == "apt-get update -qq"
    install = calls[1].split()
    assert install[:4] == ["apt-get", "install", "-y", "-qq"]
    assert set(_COMMANDS.values()) <= set(install[4:])


def test_only_the_missing_package_is_installed(tmp_path: pathlib.Path) -> None:
    proc, calls = _packages_sh(tmp_path, have=set(_COMMANDS) - {"prometheus"}, uid=0)
    assert proc.returncode == 0, proc.stderr
    assert calls[-1] == "apt-get install -y -qq prometheus"
    assert "installing prometheus" in proc.stderr


def test_nothing_missing_installs_nothing(tmp_path: pathlib.Path) -> None:
    proc, calls = _packages_sh(tmp_path, have=set(_COMMANDS), uid=0)
    assert (proc.returncode, calls, proc.stderr) == (0, [], "")


def test_without_root_it_says_what_is_missing_in_one_line_and_installs_nothing(
    tmp_path: pathlib.Path,
) -> None:
    proc, calls = _packages_sh(tmp_path, have=set(_COMMANDS) - {"prometheus", "munged"}, uid=1000)
    assert proc.returncode == 0
    assert calls == []
    (line,) = proc.stderr.splitlines()
    assert "not installing munge prometheus" in line
    assert "make test installs them" in line


def test_a_missing_locale_is_generated_as_root(tmp_path: pathlib.Path) -> None:
    proc, calls = _packages_sh(tmp_path, have=set(_COMMANDS), uid=0, locale="POSIX")
    assert proc.returncode == 0, proc.stderr
    assert calls == ["localedef -i en_US -f UTF-8 en_US.UTF-8"]
