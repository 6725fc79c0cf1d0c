"""bench_pfs.py's pinned part without a bed: the CPU lists, the ceiling child, the report.

The pinned measurement itself needs root and a MooseFS bed and is never run by the tests.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_pfs  # noqa: E402
import common  # noqa: E402
import pfs_ceiling  # noqa: E402
import pfs_pinned  # noqa: E402

from shardio import PackOptions, ShardDataset, ShardReader, pack  # noqa: E402


@pytest.mark.parametrize(
    ("text", "cpus"), [("0", {0}), ("0-2", {0, 1, 2}), ("3,0-1", {0, 1, 3}), ("2-2", {2})]
)
def test_cpu_lists_parse(text: str, cpus: set[int]) -> None:
    assert pfs_pinned.parse_cpu_list(text, {0, 1, 2, 3}) == cpus


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("a-b", "malformed"),
        ("1-", "malformed"),
        ("0,,1", "malformed"),
        ("-1", "malformed"),
        ("1-0", "backwards"),
        ("99", "not online"),
        ("0-99999", "malformed"),
        ("٣", "malformed"),  # a digit to str.isdigit, not a CPU number
        ("0" * 300, "too long"),
    ],
)
def test_bad_cpu_lists_are_refused_in_one_line(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as info:
        pfs_pinned.parse_cpu_list(text, {0, 1})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--parts", "pinned", "--bed-cpus", "0", "--reader-cpus", "0"], "overlap on CPU 0"),
        (["--parts", "pinned", "--bed-cpus", "0"], "needs --reader-cpus"),
        (["--parts", "pinned", "--bed-cpus", "x", "--reader-cpus", "0"], "--bed-cpus takes"),
        (["--parts", "read,pinned", "--bed-cpus", "0", "--reader-cpus", "1"], "runs alone"),
        (["--parts", "read", "--reader-cpus", "0"], "--reader-cpus is for --parts pinned"),
    ],
)
def test_pinned_options_are_checked_before_anything_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        bench_pfs.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    src = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(0)
    for c in range(3):
        (src / f"c{c}").mkdir()
        for i in range(40):
            size = int(rng.integers(100, 5000))
            (src / f"c{c}" / f"{i:03d}.jpeg").write_bytes(rng.bytes(size))
    dst = tmp_path_factory.mktemp("dst") / "ds"
    pack(str(src), str(dst), PackOptions(shard_size_bytes=64 << 10))
    return dst


@pytest.mark.parametrize("workers", [0, 2])
def test_the_ceiling_reads_every_member_once(
    packed: pathlib.Path, tmp_path: pathlib.Path, workers: int
) -> None:
    result = tmp_path / "r.json"
    argv = [str(packed), str(result), "--batch-size", "16", "--workers", str(workers)]
    assert pfs_ceiling.ceiling_child(argv) == 0
    got = json.loads(result.read_text())
    index = ShardReader(packed).index
    assert got["samples"] == len(index.samples) == 120
    assert got["bytes"] == int(index.members["size"].sum())
    assert got["time_s"] > 0 and got["cpu_s"] >= 0
    assert len(ShardReader(packed).manifest.shards) > 1  # random reads across shards
    assert ShardDataset(packed, mode="map", seed=0).epoch_order().tolist() != list(range(120))


def test_the_pinned_report_renders_ratios_and_verdicts() -> None:
    def tally(name: str, cold: list[float | None]) -> pfs_pinned.Tally:
        rd = pfs_pinned.Reader(name, name, "random", ["x"], "/d")
        t = pfs_pinned.Tally(rd)
        t.runs["cold"] = [pfs_pinned.Run(v, 0.5, 0.2, 10, 100) if v else None for v in cold]
        t.runs["warm"] = [pfs_pinned.Run(0.1, 0.1, 0.0, 10, 100)]
        t.allowed = {"0"}
        return t

    cat = tally("cat-shards", [1.0, 1.0])
    ceiling = tally("ceiling", [1.25, 1.25])
    smap = tally("shardio-map-auto", [2.0, 2.5])
    stream = tally("shardio-stream-auto", [1.0, None])
    failed = tally("wds", [None, None])
    failed.status, failed.note = "failed", "exit 1: boom"
    lines = pfs_pinned.verdicts([cat, ceiling, smap, stream, failed])
    assert "1.000x → **PASS**" in lines[0]  # stream vs cat
    assert "1.250x → **PASS**" in lines[1]  # stream vs the ceiling
    assert lines[2].endswith("stream mode, either target (vs `cat`, or vs the ceiling): **PASS**")
    assert "0.450x → **FAIL**" in lines[3]  # map vs cat: median of 0.5 and 0.4
    assert "0.562x → **FAIL**" in lines[4]  # map vs ceiling: median of 0.625 and 0.5
    assert lines[5].endswith("**FAIL**")
    state = common.code_state(bench_pfs.REPO)
    facts = {
        "files": 10, "mean_kb": 110.0, "payload": 1000, "shards": 1, "shard_bytes": 2000,
        "bed_argv": "up", "mfs_version": "MFS", "bed_cpus": "1", "reader_cpus": "0",
        "batch_size": 64, "workers": 2, "rounds": 2, "bed_pids": {7: "mfsmount"},
        "bed_allowed": {7: {"1"}}, "argv": "bench", "started": "now", "elapsed_s": 60.0,
        "load_before": "1", "load_after": "2", "child_cmd": "c", "versions": "v",
        "code_line": common.code_line(state, state, "read"),
    }  # fmt: skip
    body = pfs_pinned.report([cat, ceiling, smap, stream, failed], ["1 1 1", "2 2 2"], facts)
    assert "| mfsmount | 7 | 1 |" in body
    assert "failed: exit 1: boom" in body
    assert "`Cpus_allowed_list` 0." in body
