"""benchmarks/bench_cpu.py without measuring: the floor reader, the options, the report.

The benchmark itself (root, minutes, the peers) is never run by the tests; these check that
the floor hashes exactly the bytes a tar holds, that bad options are refused in one line, and
that the figures, ratios and verdicts follow from the runs they are given.
"""

from __future__ import annotations

import io
import os
import pathlib
import sys
import tarfile
from typing import Any

import pytest
import xxhash

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_cpu  # noqa: E402
import common  # noqa: E402
import cpu_report  # noqa: E402


def _tar(path: pathlib.Path, members: dict[str, bytes], fmt: int) -> None:
    with tarfile.open(path, "w", format=fmt) as tar:
        folder = tarfile.TarInfo("dir")
        folder.type = tarfile.DIRTYPE  # not a regular file: skipped
        tar.addfile(folder)
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_the_floor_hashes_each_member_and_each_shard(tmp_path: pathlib.Path, fmt: int) -> None:
    long = "n" * 150 if fmt != tarfile.USTAR_FORMAT else "n" * 90  # pax / GNU long names
    members = {f"{long}.jpeg": b"\xff\xd8" * 3000, "s1.cls": b"7", "empty": b"", "s2.jpeg": b"x"}
    shards = []
    for i in range(2):
        shards.append(tmp_path / f"{i}.tar")
        _tar(shards[-1], members, fmt)
    per_member = bench_cpu.read_floor([str(s) for s in shards], members=True, epochs=1)
    want = 0
    for _ in shards:
        for data in members.values():
            want ^= xxhash.xxh3_64_intdigest(data)
    assert per_member["digest"] == want
    assert per_member["hashes"] == 2 * len(members)
    assert per_member["hashed_bytes"] == 2 * sum(len(d) for d in members.values())
    whole = bench_cpu.read_floor([str(s) for s in shards], members=False, epochs=3)
    sizes = [s.stat().st_size for s in shards]
    assert whole["read_bytes"] == whole["hashed_bytes"] == 3 * sum(sizes)
    assert whole["hashes"] == 6
    # Each shard hashed as one stream (xor over an odd number of epochs: one pass's digests).
    one = [xxhash.xxh3_64_intdigest(s.read_bytes()) for s in shards]
    assert whole["digest"] == one[0] ^ one[1]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_the_ceilings_read_and_hash_what_the_floor_does(tmp_path: pathlib.Path, fmt: int) -> None:
    long = "n" * 150 if fmt != tarfile.USTAR_FORMAT else "n" * 90
    shards = []
    for i in range(3):
        shards.append(str(tmp_path / f"{i}.tar"))
        members = {f"{long}{i}.jpeg": bytes([i]) * (9000 + i), f"s{i}.cls": b"%d" % i, "e": b""}
        _tar(pathlib.Path(shards[-1]), members, fmt)
    per_member = bench_cpu.read_floor(shards, members=True, epochs=1)
    # The member list comes from the headers alone, as the whole-shard walk finds it.
    for path in shards:
        data = memoryview(pathlib.Path(path).read_bytes())
        assert bench_cpu.member_extents(path) == list(bench_cpu.tar_members(data, len(data)))
    extents = bench_cpu.open_extents(shards)
    try:
        # Random order: every member once per epoch, whatever the order (xor: 3 epochs = 1).
        shuffled = bench_cpu.read_floor_shuffled(extents, epochs=3, seed=5)
        assert shuffled["digest"] == per_member["digest"]
        assert shuffled["hashes"] == 3 * per_member["hashes"]
        assert shuffled["read_bytes"] == 3 * per_member["hashed_bytes"]
        assert bench_cpu.epoch_order(9, 5, 1) != bench_cpu.epoch_order(9, 5, 2)
        split = bench_cpu.read_floor_shuffled(extents, epochs=2, seed=5, procs=2)
        assert split["read_bytes"] == 2 * per_member["hashed_bytes"]
        for epochs in (1, 2):  # each epoch's batches, two workers, kept between epochs
            loader = bench_cpu.read_floor_loader(
                extents, workers=2, batch_size=2, epochs=epochs, seed=5
            )
            assert loader["read_bytes"] == epochs * per_member["hashed_bytes"]
            assert loader["digest"] == (per_member["digest"] if epochs == 1 else 0)
            # 9 members (a share of 5 and of 4): 3 and 2 batches an epoch.
            assert loader["hashes"] == 5 * epochs
    finally:
        for fd in {fd for fd, _, _ in extents}:
            os.close(fd)


def test_a_failed_reader_process_is_an_error(tmp_path: pathlib.Path) -> None:
    good = tmp_path / "good.tar"
    _tar(good, {"a.jpeg": b"a" * 100, "b.jpeg": b"b" * 100}, tarfile.USTAR_FORMAT)
    extents = bench_cpu.open_extents([str(good)])
    good.write_bytes(good.read_bytes()[:2048])  # the second member is cut off
    with pytest.raises(RuntimeError, match="1 of 2 floor readers failed"):
        bench_cpu.read_floor_shuffled(extents, procs=2)
    os.close(extents[0][0])


def test_a_truncated_tar_is_an_error(tmp_path: pathlib.Path) -> None:
    shard = tmp_path / "cut.tar"
    _tar(shard, {"a.jpeg": b"y" * 5000}, tarfile.USTAR_FORMAT)
    shard.write_bytes(shard.read_bytes()[:3000])
    with pytest.raises(ValueError, match="runs past the end"):
        bench_cpu.read_floor([str(shard)], members=True)
    with pytest.raises(ValueError, match=r"cut\.tar: a tar member at byte 512 runs past the end"):
        bench_cpu.member_extents(str(shard))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--repeat", "0"], "--repeat must be 1"),
        (["--epochs", "-1"], "--epochs must be 1"),
        (["--workers", "100000"], "--workers must be 1 to 64"),
        (["--timeout", "inf"], "--timeout ≤ 86400"),
        (["--peer-repeat", "4"], "--peer-repeat must be 0 to --repeat"),
        (["--mean-kb", "nan"], "--mean-kb and --timeout must be positive"),
        (["--fs", "local,nfs"], "--fs takes a comma-separated subset"),
        (["--fs", "local,local"], "--fs takes"),
        (["--cache", ""], "--cache takes"),
        (["--shard-size", "12XB"], "--shard-size"),
        (["--baseline", "no-such-rev"], "is not a commit"),
        (["--only", "floor,bogus"], "unknown --only names"),
    ],
)
def test_bad_options_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        bench_cpu._parse([*argv, "--cache", "warm"] if "--cache" not in argv else argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def _outcome(name: str, runs: dict[tuple[str, str], list[tuple[float, float]]]) -> Any:
    cfg = next(c for c in bench_cpu.configs(2, "abc1234") if c.name == name)
    o = bench_cpu.Outcome(cfg)
    for key, pairs in runs.items():
        o.runs[key] = [
            {"time_s": wall, "cpu_s": cpu, "bytes": 2e9, "samples": 20000} for wall, cpu in pairs
        ]
    return o


def test_figures_ratios_and_verdicts() -> None:
    lw, lc = ("local", "warm"), ("local", "cold")
    outcomes = [
        _outcome("floor", {lw: [(1.0, 0.8), (1.0, 0.9), (2.0, 1.0)], lc: [(2.0, 1.0)]}),
        _outcome("shardio-map-w2", {lw: [(0.5, 1.2), (0.6, 1.4), (0.7, 1.3)], lc: [(2.5, 2.0)]}),
        _outcome("shardio-map-w2-base", {lw: [(0.8, 2.6)], lc: [(2.0, 2.4), (2.9, 2.4)]}),
    ]
    outcomes[1].status["bed"] = "failed (exit 1): boom"
    floor = cpu_report.cell(outcomes[0], "local", "warm")
    assert floor is not None
    assert floor["cpu_gb"] == pytest.approx(0.45)  # median of 0.4, 0.45, 0.5
    assert floor["cpu_1000"] == pytest.approx(0.045)
    assert floor["mbs"] == pytest.approx(2000)
    assert cpu_report.vs_floor(outcomes[1], outcomes, "local", "warm") == pytest.approx(0.65 / 0.45)
    lines = cpu_report.floor_verdicts(outcomes, ["local", "bed"], ["warm", "cold"])
    assert len(lines) == 4  # the baseline row has no verdict of its own
    assert "1.44x → **PASS**" in lines[0]
    assert "2.00x → **FAIL**" in lines[1]
    assert lines[2].endswith("not measured")
    rows, verdicts = cpu_report.baseline_rows(outcomes, ["local"], ["warm", "cold"])
    assert [r[5] for r in rows] == ["0.75x", "1.02x"]
    assert verdicts[0].endswith("**PASS**")
    assert verdicts[1].endswith("**PASS** (within the old runs' spread)")  # 2.5 ≤ max 2.9
    outcomes[1].runs[lc] = [{"time_s": 3.0, "cpu_s": 2.0, "bytes": 2e9, "samples": 20000}]
    assert cpu_report.baseline_rows(outcomes, ["local"], ["cold"])[1][0].endswith("**FAIL**")
    table = cpu_report.table(outcomes, "bed", "warm")
    assert "failed (exit 1): boom" in table


def test_each_shardio_row_is_given_against_its_ceiling() -> None:
    names = {c.name: c for c in bench_cpu.configs(2, "")}
    assert cpu_report.ceiling_of(names["shardio-map-w0"]) == "floor-shuffled"
    assert cpu_report.ceiling_of(names["shardio-stream-w0"]) == "floor-shuffled"
    assert cpu_report.ceiling_of(names["shardio-map-w2"]) == "floor-loader-w2"
    assert cpu_report.ceiling_of(names["shardio-stream-t2"]) == "floor-shuffled-p2"
    assert cpu_report.ceiling_of(names["wds"]) == ""
    assert all(cpu_report.ceiling_of(names[c]) in names for c in names if names[c].shardio)
    lw = ("local", "warm")
    outcomes = [
        _outcome("floor", {lw: [(1.0, 0.5)]}),
        _outcome("floor-loader-w2", {lw: [(1.0, 0.8)]}),
        _outcome("shardio-map-w2", {lw: [(1.0, 1.0)]}),
        _outcome("shardio-map-w0", {lw: [(1.0, 0.7)]}),
    ]
    assert cpu_report.vs_ceiling(outcomes[2], outcomes, "local", "warm") == pytest.approx(1.25)
    assert cpu_report.vs_ceiling(outcomes[3], outcomes, "local", "warm") is None  # not run
    assert cpu_report.vs_ceiling(outcomes[0], outcomes, "local", "warm") is None  # a floor
    lines = cpu_report.floor_verdicts(outcomes, ["local"], ["warm"])
    assert lines[0].endswith("2.00x → **FAIL**; 1.25x its ceiling (floor-loader-w2)")
    assert lines[1].endswith("1.40x → **PASS**")
    table = cpu_report.table(outcomes, "local", "warm")
    assert "| 2.00x | 1.25x | 1 |" in table


def test_the_report_renders(tmp_path: pathlib.Path) -> None:
    args = bench_cpu._parse(["--cache", "warm", "--baseline", "none", "--only", "floor,cat"])
    args.cold_ok = True
    outcomes = [_outcome("floor", {("local", "warm"): [(1.0, 0.5)]}), _outcome("cat", {})]
    shard = tmp_path / "0.tar"
    shard.write_bytes(b"\0" * 1024)
    state = common.CodeState(head="abc", dirty=False, files={})
    facts = {
        "started": "now", "load_before": "1 1 1", "load_after": "2 2 2", "elapsed_s": 3.0,
        "code_before": state, "code_after": state, "sizes": (10000, 10**9),
        "shards": [str(shard)],
    }  # fmt: skip
    body = cpu_report.report(outcomes, args, facts)
    assert "| floor: `readinto` 8 MiB + xxh3-64 per shard | 1.00 (1.00-1.00)" in body
    assert "not run" in body  # cat has no run
    assert f"{sys.executable} benchmarks/bench_cpu.py --cache warm --baseline none" in body


def test_a_baseline_tree_gets_its_compiled_modules_built(tmp_path: pathlib.Path) -> None:
    """A worktree holds no build: its rows would measure the pure-Python fallback."""
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    assert bench_cpu.build_native(str(tmp_path)) == []  # a commit before any existed
    (tmp_path / "pyproject.toml").write_text(
        "[[tool.setuptools.ext-modules]]\nname = 'pkg._gone'\nsources = ['pkg/_gone.c']\n"
    )
    with pytest.raises(RuntimeError, match="compiled modules failed"):
        bench_cpu.build_native(str(tmp_path))
