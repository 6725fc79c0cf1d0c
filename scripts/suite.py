#!/usr/bin/env python3
"""Run shardio's test suite the way ``make test`` and ``make test-fast`` do, and report on it.

    suite.py test [PYTEST_ARGS...]   the whole suite: two pytest runs side by side (below)
    suite.py fast [PYTEST_ARGS...]   the tests recorded under 0.2 s, on every CPU
    suite.py record                  write tests/durations.json from the last ``test`` run
    suite.py budget                  the slowest tests and the totals of the last runs

``test`` runs the tests on real components (the MooseFS bed, the SLURM cluster, Prometheus:
they mostly wait on daemons and deadlines) in one pytest beside all the others in a second,
each line of each prefixed by its run (``main |``, ``real |``) as it happens, a progress line
every 20 s in place of the dots. At the end: each run's groups (what ran, what was skipped and
why), its wall time, the slowest tests, and the budget (:data:`BUDGET_S`). The reports of the
last runs stay in ``.test-reports/``; ``record`` turns a passing ``test`` run's into
``tests/durations.json``, from which tests/suite_plugin.py derives the fast selection.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
REPORTS = REPO / ".test-reports"
DURATIONS = REPO / "tests" / "durations.json"
REAL = "pfs or slurm or prometheus"
NOT_HERE = "not gpu and not bench"
REAL_DIRS = ("tests/pfs", "tests/slurm", "tests/prometheus")
# Wall-time budgets on a quiet 2-core machine of the CI kind (issue 33).
BUDGET_S = {"test": 720.0, "fast": 60.0}
SLOWEST = 20
REAL_WORKERS = 4
# A test recorded as fast that took this many times the limit in a run is reported.
DRIFT_FACTOR = 5.0

sys.path.insert(0, str(REPO / "tests"))
from suite_plugin import FAST_LIMIT_S, Record  # noqa: E402

_print_lock = threading.Lock()


def _say(line: str) -> None:
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _relay(stream: object, prefix: str) -> None:
    for raw in stream:  # type: ignore[attr-defined]
        _say(prefix + raw.rstrip("\n"))


def _run_dir() -> pathlib.Path:
    """This run's reports: ``.test-reports/run-PID`` (two runs at once keep theirs apart);
    ``.test-reports/last`` names the last run that ended."""
    REPORTS.mkdir(exist_ok=True)
    mine = REPORTS / f"run-{os.getpid()}"
    mine.mkdir(exist_ok=True)
    return mine


def _publish(run_dir: pathlib.Path) -> None:
    """Point ``last`` at ``run_dir`` (a new link renamed over it); drop older runs' reports
    whose process is gone."""
    link = REPORTS / f".last-{os.getpid()}"
    link.unlink(missing_ok=True)
    link.symlink_to(run_dir.name)
    os.replace(link, REPORTS / "last")
    for old in REPORTS.glob("run-*"):
        pid = old.name.removeprefix("run-")
        if old == run_dir or not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue
        if old.is_symlink() or not old.is_dir():  # not a directory this script made
            continue
        for label in ("main", "real", "fast"):  # only the reports it writes, never a link
            f = old / f"{label}.json"
            if f.is_file() and not f.is_symlink():
                f.unlink()
        with contextlib.suppress(OSError):
            old.rmdir()


def _start(label: str, args: list[str]) -> subprocess.Popen[str]:
    report = _run_dir() / f"{label}.json"
    env = dict(os.environ, SHARDIO_TEST_PROGRESS=label, SHARDIO_TEST_REPORT=str(report))
    env["PYTHONUNBUFFERED"] = "1"
    # Bytecode caches are written (__pycache__, git-ignored) even where the environment says
    # not to: without them each of the suite's many Python processes compiles the
    # shardio modules it imports again, and each pytest worker rewrites every test module's
    # asserts at collection (about 9 s a worker), together minutes of the 12-minute budget.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        encoding="utf-8", errors="replace", bufsize=1,
    )  # fmt: skip


def _run(runs: dict[str, list[str]]) -> dict[str, tuple[int, float]]:
    """Start each run, relay its lines as they come, wait for all: {label: (rc, wall_s)}."""
    started = time.monotonic()
    procs = {label: _start(label, args) for label, args in runs.items()}

    def forward(signum: int, frame: object) -> None:
        # A CI timeout or `kill`: each pytest unwinds (beds and clusters taken down) and
        # writes its report; this waits for them below.
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, forward)
    width = max(map(len, procs))
    relays = [
        threading.Thread(target=_relay, args=(p.stdout, f"{label:<{width}} | "), daemon=True)
        for label, p in procs.items()
    ]
    for t in relays:
        t.start()
    results: dict[str, tuple[int, float]] = {}
    try:
        while len(results) < len(procs):  # each run's wall time when it ends, in any order
            for label, proc in procs.items():
                rc = proc.poll()
                if rc is not None and label not in results:
                    results[label] = (rc, time.monotonic() - started)
            time.sleep(0.2)
    except KeyboardInterrupt:  # pytest's own Ctrl-C handling takes the beds down
        for proc in procs.values():
            proc.wait()
        raise
    for t in relays:
        t.join(timeout=10)
    _publish(_run_dir())
    return results


def _load(label: str, run_dir: pathlib.Path | None = None) -> dict[str, object] | None:
    """A run's report (the last run's without ``run_dir``), or None: none, or not JSON."""
    where = run_dir if run_dir is not None else REPORTS / "last"
    try:
        data = json.loads((where / f"{label}.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _minutes(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def summary(
    labels: list[str],
    walls: dict[str, tuple[int, float]] | None,
    kind: str,
    run_dir: pathlib.Path | None = None,
) -> int:
    """Print each run's groups and wall time, the slowest tests, the totals and the budget;
    return the number of runs without a report."""
    reports = {label: _load(label, run_dir) for label in labels}
    record = Record.load(DURATIONS)
    times: dict[str, tuple[float, str]] = {}
    missing = 0
    _say("")
    _say(f"=== shardio {kind}: summary ===")
    for label, report in reports.items():
        if report is None:
            missing += 1
            _say(f"{label}: no report (pytest ended before writing one)")
            continue
        tests = report["tests"]
        assert isinstance(tests, dict)
        outcomes: dict[str, int] = {}
        for nodeid, (seconds, outcome, _) in tests.items():
            times[nodeid] = (seconds, outcome)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        counts = ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
        wall = walls[label][1] if walls else float(report["wall_s"])  # type: ignore[arg-type]
        _say(f"{label}: {counts or 'no tests'}; {report['deselected']} deselected; "
             f"wall {_minutes(wall)}")  # fmt: skip
        for line in report["group_lines"]:  # type: ignore[union-attr]
            _say(f"  {line.strip()}")
        for problem in report["problems"]:  # type: ignore[union-attr]
            _say(f"  {problem}")
    slowest = sorted(times.items(), key=lambda kv: kv[1][0], reverse=True)[:SLOWEST]
    if slowest:
        _say(f"slowest {len(slowest)} tests:")
        for nodeid, (seconds, outcome) in slowest:
            mark = "" if outcome == "passed" else f" ({outcome})"
            _say(f"  {seconds:7.1f} s  {nodeid}{mark}")
    fixtures = [
        (seconds, f"{label}: {name}", count)
        for label, report in reports.items() if report is not None
        for name, (count, seconds) in report.get("fixtures", {}).items()  # type: ignore[union-attr]
    ]  # fmt: skip
    if fixtures:
        _say("costliest fixtures (set-up, all workers):")
        for seconds, name, count in sorted(fixtures, reverse=True)[:5]:
            _say(f"  {seconds:7.1f} s  {name} (x{count})")
    total = sum(seconds for seconds, _ in times.values())
    wall = max((w for _, w in walls.values()), default=0.0) if walls else 0.0
    _say(f"total: {len(times)} tests, {total:.0f} s of test time"
         + (f", {_minutes(wall)} wall" if walls else ""))  # fmt: skip
    budget = BUDGET_S[kind]
    if walls:
        verdict = "within" if wall <= budget else f"OVER by {_minutes(wall - budget)}:"
        _say(f"budget: {_minutes(wall)} wall, {verdict} the {_minutes(budget)} budget "
             "(on a quiet 2-core machine)")  # fmt: skip
    unrecorded = [n for n in times if n not in record.own]
    drifted = [
        n for n, (s, _) in times.items() if record.is_fast(n) and s >= DRIFT_FACTOR * FAST_LIMIT_S
    ]
    if kind == "test" and unrecorded:
        _say(f"fast selection: {len(unrecorded)} test(s) not in tests/durations.json, left out "
             "of make test-fast until `make test-durations` records them")  # fmt: skip
    if drifted:
        shown = ", ".join(drifted[:5]) + (" ..." if len(drifted) > 5 else "")
        _say(
            f"fast selection: {len(drifted)} test(s) recorded under {FAST_LIMIT_S} s took "
            f"{DRIFT_FACTOR:g}x that or more here: {shown} (`make test-durations` if it holds)"
        )
    return missing


def _workers(default: int, variable: str) -> list[str]:
    """pytest-xdist's options for ``default`` workers (``variable`` overrides; 0: none)."""
    raw = os.environ.get(variable, "")
    try:
        n = int(raw) if raw else default
    except ValueError:
        raise SystemExit(f"suite.py: {variable} must be a whole number, got {raw!r}") from None
    n = max(0, min(n, 64))
    return ["-n", str(n), "--dist", "worksteal"] if n else []


def cmd_test(args: list[str]) -> int:
    cpus = len(os.sched_getaffinity(0))
    runs = {
        # Mostly waiting on daemons and deadlines: more workers than CPUs.
        "real": [*_workers(REAL_WORKERS, "SHARDIO_TEST_REAL_WORKERS"), "-m",
                 f"({REAL}) and {NOT_HERE}", *args, *REAL_DIRS],
        "main": [*_workers(max(2, cpus), "SHARDIO_TEST_WORKERS"), "-m",
                 f"not ({REAL}) and {NOT_HERE}", *args],
    }  # fmt: skip
    walls = _run(runs)
    missing = summary(list(runs), walls, "test", _run_dir())
    failed = {label: rc for label, (rc, _) in walls.items() if rc != 0}
    if failed:
        _say_failures(list(runs))
        _say("make test: FAILED: " + ", ".join(f"{k} exit {v}" for k, v in failed.items()))
        return 1
    return 1 if missing else 0


def _say_failures(labels: list[str], run_dir: pathlib.Path | None = None) -> None:
    """The tests that failed or errored, last (a CI log's tail shows them), at most 20."""
    bad = [
        f"{label}: {nodeid} ({outcome})"
        for label in labels
        for report in [_load(label, run_dir)] if report is not None
        for nodeid, (_, outcome, _) in report["tests"].items()  # type: ignore[union-attr]
        if outcome not in ("passed", "skipped", "xfailed", "xpassed")
    ]  # fmt: skip
    if bad:
        _say(f"not passed ({len(bad)}):")
        for line in bad[:20]:
            _say(f"  {line}")


def cmd_fast(args: list[str]) -> int:
    selection = f"not slow and not ({REAL}) and {NOT_HERE}"
    cpus = len(os.sched_getaffinity(0))
    walls = _run({"fast": [*_workers(cpus, "SHARDIO_TEST_WORKERS"), "-m", selection, *args]})
    missing = summary(["fast"], walls, "fast", _run_dir())
    rc = walls["fast"][0]
    if rc:
        _say_failures(["fast"])
    return rc if rc else (1 if missing else 0)


def cmd_record(args: list[str]) -> int:
    tests: dict[str, dict[str, float]] = {}
    shared: dict[str, float] = {}
    fixtures: dict[str, list[float]] = {}
    for label in ("real", "main"):
        report = _load(label)
        if report is None:
            _say(f"suite.py record: no report of the `{label}` run: run make test first")
            return 1
        if report["exitstatus"] != 0:
            _say(f"suite.py record: the last `{label}` run did not pass: nothing recorded")
            return 1
        for nodeid, (seconds, _, paid) in report["tests"].items():  # type: ignore[union-attr]
            module, _, name = nodeid.partition("::")
            tests.setdefault(module, {})[name] = round(max(seconds - paid, 0.0), 3)
            if paid:
                shared[module] = round(shared.get(module, 0.0) + paid, 3)
        for name, (count, seconds) in report.get("fixtures", {}).items():  # type: ignore[union-attr]
            if seconds >= 0.5:
                fixtures[f"{label}: {name}"] = [count, seconds]
    data = {
        "about": "seconds of each test (set-up + call + tear-down, less the module-scoped "
        "fixtures it set up: those are the module's `shared`) in one make test on the 2-core "
        "test machine; written by scripts/suite.py record, read by tests/suite_plugin.py",
        "fixtures_about": "set-up of the fixtures broader than a test that took 0.5 s or "
        "more in all: run: scope name -> [times set up (once per xdist worker), seconds]",
        "fixtures": dict(sorted(fixtures.items(), key=lambda kv: -kv[1][1])),
        "shared": dict(sorted(shared.items())),
        "tests": {module: dict(sorted(t.items())) for module, t in sorted(tests.items())},
    }
    tmp = DURATIONS.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, DURATIONS)
    record = Record.load(DURATIONS)
    fast = sum(1 for nodeid in record.own if record.is_fast(nodeid))
    _say(f"suite.py record: {len(record.own)} tests in {DURATIONS.relative_to(REPO)}, {fast} fast")
    return 0


def cmd_budget(args: list[str]) -> int:
    labels = [label for label in ("real", "main", "fast") if _load(label) is not None]
    if not labels:
        _say("suite.py budget: no reports in .test-reports/: run make test first")
        return 1
    kind = "fast" if labels == ["fast"] else "test"
    summary([label for label in labels if label != "fast"] or labels, None, kind)
    return 0


def main(argv: list[str]) -> int:
    commands = {"test": cmd_test, "fast": cmd_fast, "record": cmd_record, "budget": cmd_budget}
    if not argv or argv[0] not in commands:
        _say(__doc__ or "")
        return 2
    try:
        return commands[argv[0]](argv[1:])
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
