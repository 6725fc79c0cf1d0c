"""``shardio bench`` end to end on tiny packed datasets: the JSON report and its arithmetic,
the checks (fast reads pass; slow reads alert or fail), the loose-file and webdataset peers,
the plot, the cold start and the user mistakes."""

from __future__ import annotations

import json
import os
import pathlib
import random
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
from trees import write_tree

from shardio.bench import loop as bench_loop
from shardio.bench.loop import drop_page_cache
from shardio.bench.peers import list_regular_files
from shardio.bench.report import check_run
from shardio.bench.runners import run_shardio
from shardio.bench.settings import BenchSettings
from shardio.format.manifest import load_manifest
from shardio.order.quality import order_quality
from shardio.order.spec import resolve_spec
from shardio.packing.run import PackOptions, pack
from shardio.read.faults import Fault, FaultyOpener
from shardio.read.reader import ShardReader

CLASSES = 3
PER_CLASS = 40
SAMPLES = CLASSES * PER_CLASS
BATCH = 16
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHECK_NAMES = {"read_latency_p99", "step_time_std", "au"}


class Data(NamedTuple):
    src: pathlib.Path
    tar: pathlib.Path
    hdf5: pathlib.Path
    payload_bytes: int


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    """120 files of 1-4 KB in 3 class directories, packed as tar and as hdf5 (9 shards)."""
    root = tmp_path_factory.mktemp("bench")
    rng = random.Random(7)
    files = {
        f"train/c{c}/img{i:04d}.jpg".encode(): rng.randbytes(rng.randint(1000, 4000))
        for c in range(CLASSES)
        for i in range(PER_CLASS)
    }
    src = pathlib.Path(write_tree(root / "src", files))
    out = {}
    for fmt in ("tar", "hdf5"):
        dst = root / fmt
        result = pack(
            os.fspath(src),
            os.fspath(dst),
            PackOptions(shard_format=fmt, shard_size_bytes=64 * 1024, durable=False),
        )
        assert result.num_samples == SAMPLES
        assert result.num_shards > 2
        out[fmt] = dst
    return Data(src, out["tar"], out["hdf5"], sum(len(v) for v in files.values()))


def _json(result: Any) -> dict[str, Any]:
    assert result.rc == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    report = json.loads(result.stdout)  # stdout holds the JSON object and nothing else
    assert set(report) == {"settings", "runs", "checks"}
    return report


def _checks_of(report: dict[str, Any], runner: str) -> dict[str, str]:
    found = {c["name"]: c["status"] for c in report["checks"] if c["runner"] == runner}
    assert all(s in ("PASS", "ALERT", "FAIL") for s in found.values()), found
    return found


def test_json_report_is_consistent_and_fast_reads_pass(run_cli: Any, data: Data) -> None:
    result = run_cli(
        "bench", data.tar, "--json", "--compute-ms", "20", "--workers", "1",
        "--batch", str(BATCH), "--epochs", "2",
    )  # fmt: skip
    report = _json(result)
    # The filesystem and read strategy shown depend on the machine: test_cli_read_path.py.
    assert {
        k: v for k, v in report["settings"].items() if k not in {"filesystem", "read_strategy"}
    } == {
        "dataset": os.fspath(data.tar),
        "mode": "map",
        "workers": 1,
        "batch_size": BATCH,
        "compute_ms": 20.0,
        "epochs": 2,
        "seed": 0,
        "cold": False,
        "compare": [],
        "plot": None,
    }
    (run,) = report["runs"]
    assert run["runner"] == "shardio"
    batches_per_epoch = -(-SAMPLES // BATCH)
    assert run["samples"] == SAMPLES * 2
    assert run["batches"] == batches_per_epoch * 2
    assert run["bytes_read"] == data.payload_bytes * 2
    assert run["read_latency"]["count"] == SAMPLES * 2  # one member read per sample
    assert len(run["first_wait_s"]) == 2
    assert run["steps"] == run["batches"] - 2  # each epoch's first batch starts no step
    assert 0.0 <= run["au"] <= 1.0
    assert 0.0 <= run["stall_fraction"] <= 1.0
    # The epochs' wall time is exactly their waits plus their compute (the loop's clock).
    assert run["wall_s"] == pytest.approx(run["wait_s"] + run["compute_s"], abs=1e-6)
    assert run["au"] == pytest.approx(run["compute_s"] / run["wall_s"])
    assert run["compute_s"] >= run["batches"] * 0.020  # a sleep never ends early
    assert run["files_opened"] > 0
    windows = run["timeline"]
    assert windows
    assert all(0.0 <= w["stall_fraction"] <= 1.0 for w in windows)
    delivered = sum(
        w["samples_per_s"] * min(w["width_s"], run["wall_s"] - w["start_s"]) for w in windows
    )
    assert delivered == pytest.approx(SAMPLES * 2)
    checks = _checks_of(report, "shardio")
    assert set(checks) == CHECK_NAMES
    assert checks["read_latency_p99"] == "PASS"  # KB-sized reads of local files
    # The shuffle quality of the order read: map mode's default (random) at seed 0, per epoch.
    quality = run["order_quality"]
    assert [q["epoch"] for q in quality] == [0, 1]
    with ShardReader(os.fspath(data.tar)) as reader:
        sizes = [s.num_samples for s in reader.manifest.shards]
        labels = reader.index.samples["label"]
        for epoch, found in enumerate(quality):
            spec = resolve_spec("map", None, seed=0)
            expected = order_quality(sizes, labels, spec, epoch=epoch, batch_size=BATCH)
            assert found == expected.to_dict()
    assert quality[0]["rho"] != quality[1]["rho"]  # reshuffled


@pytest.mark.parametrize(("delay_s", "status"), [(0.06, "ALERT"), (0.12, "FAIL")])
def test_slow_reads_alert_or_fail_the_latency_check(
    data: Data, delay_s: float, status: str
) -> None:
    # Three slow reads of 120 (2.5%) carry the P99: what the CLI reports for slow storage.
    opener = FaultyOpener([Fault(kind="slow", delay_s=delay_s, times=3)])
    settings = BenchSettings(workers=0, batch_size=BATCH, compute_ms=1.0)
    run = run_shardio(os.fspath(data.tar), settings, opener=opener)
    assert run.samples == SAMPLES
    assert run.read_latency is not None
    assert run.read_latency.max_s >= delay_s
    checks = {c.name: c for c in check_run(run)}
    assert checks["read_latency_p99"].status == status, checks["read_latency_p99"]
    assert f"{run.read_latency.p99_s * 1e3:.1f} ms" in checks["read_latency_p99"].text


def test_compare_loose_and_webdataset_with_plot(
    run_cli: Any, data: Data, tmp_path: pathlib.Path
) -> None:
    png = tmp_path / "bench.png"
    result = run_cli(
        "bench", data.tar, "--json", "--compute-ms", "1", "--workers", "2", "--batch",
        str(BATCH), "--compare", f"loose:{data.src}", "--compare", "webdataset",
        "--plot", png,
    )  # fmt: skip
    report = _json(result)
    assert report["settings"]["compare"] == [f"loose:{data.src}", "webdataset"]
    assert report["settings"]["plot"] == os.fspath(png)
    assert [r["runner"] for r in report["runs"]] == ["shardio", "loose", "webdataset"]
    _, loose, wds = report["runs"]
    for run in report["runs"]:
        assert run["samples"] == SAMPLES, run["runner"]
        assert run["bytes_read"] == data.payload_bytes, run["runner"]
        assert 0.0 <= run["au"] <= 1.0
    assert loose["read_latency"]["count"] == SAMPLES  # one timed open+read per file
    assert loose["files_opened"] == SAMPLES
    assert wds["read_latency"] is None  # webdataset cannot time its reads
    assert wds["files_opened"] == len(load_manifest(data.tar / "manifest.json").shards)
    assert set(_checks_of(report, "shardio")) == CHECK_NAMES
    assert set(_checks_of(report, "loose")) == CHECK_NAMES
    assert set(_checks_of(report, "webdataset")) == CHECK_NAMES - {"read_latency_p99"}
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    assert png.stat().st_size > 10_000  # three panels, not an empty canvas


def test_text_report_lists_runs_checks_and_the_first_step(
    run_cli: Any, data: Data, tmp_path: pathlib.Path
) -> None:
    result = run_cli(
        "bench", data.hdf5, "--mode", "stream", "--compute-ms", "2", "--workers", "0",
        "--batch", str(BATCH), "--compare", f"loose:{data.src}",
    )  # fmt: skip
    assert result.rc == 0, result.stderr
    out = result.stdout
    assert "shardio: " in out
    assert "hdf5 shards" in out
    assert f"loose: {data.src} ({SAMPLES} loose files)" in out
    assert "first step of each epoch is left out" in out
    assert "compared with shardio" in out
    assert "  order         epoch 0 shuffle: label entropy " in out  # stream: shard-local
    assert "(order=shard-local,seed=0,window=4,partition=none,drop_last=0; shardio " in out
    check_lines = [ln.split() for ln in out.splitlines() if ln.startswith("  PASS") or
                   ln.startswith("  FAIL") or ln.startswith("  ALERT")]  # fmt: skip
    assert {(w[0], w[1]) for w in check_lines} >= {("PASS", "shardio"), ("PASS", "loose")}
    assert len(check_lines) == 6  # three checks per runner


def test_cold_without_drop_caches_evicts_each_file(
    data: Data, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = [
        os.fspath(data.tar / s.path) for s in load_manifest(data.tar / "manifest.json").shards
    ]
    link = tmp_path / "link"
    link.symlink_to(shards[0])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    note = drop_page_cache([*shards, os.fspath(link), os.fspath(fifo)], allow_global=False)
    # The symlink is not followed and the FIFO neither blocks nor counts.
    assert f"evicted the {len(shards)} files" in note
    assert "POSIX_FADV_DONTNEED" in note

    def no_global(paths: list[str], *, allow_global: bool = True) -> str:
        return drop_page_cache(paths, allow_global=False)

    monkeypatch.setattr(bench_loop, "drop_page_cache", no_global)
    settings = BenchSettings(workers=0, batch_size=BATCH, compute_ms=0.0, epochs=2, cold=True)
    run = run_shardio(os.fspath(data.tar), settings)
    assert run.samples == SAMPLES * 2
    assert any(f"evicted the {len(shards)} files" in n for n in run.notes), run.notes


def test_loose_listing_skips_symlinks_and_special_files(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "tree"
    write_tree(root, {b"a/1.bin": b"x", b"b/2.bin": b"yy", b".hidden": b"z"})
    outside = tmp_path / "outside"
    write_tree(outside, {b"secret": b"s"})
    (root / "a" / "link").symlink_to(root / "b" / "2.bin")
    (root / "dirlink").symlink_to(outside)
    os.mkfifo(root / "fifo")
    assert list_regular_files(os.fspath(root)) == [b".hidden", b"a/1.bin", b"b/2.bin"]


def _no_matplotlib(tmp_path: pathlib.Path) -> dict[str, str]:
    """An environment where ``import matplotlib`` fails."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "matplotlib.py").write_text("raise ImportError('hidden by the test')\n")
    path = os.pathsep.join(p for p in (os.fspath(shadow), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["{missing}"], "no dataset directory"),
        (["{tar}", "--compare", "rsync"], "invalid --compare 'rsync'"),
        (["{tar}", "--compare", "loose:{missing}"], "not a directory"),
        (["{hdf5}", "--compare", "webdataset"], "holds hdf5 shards"),
        (["{tar}", "--workers", "-1"], "--workers='-1' is not a whole number"),
        (["{tar}", "--batch", "0"], "--batch must be >= 1"),
        (["{tar}", "--epochs", "0"], "--epochs must be >= 1"),
        (["{tar}", "--compute-ms", "-5"], "--compute-ms must be a number >= 0"),
        (["{tar}", "--mode", "random"], "invalid choice"),
        (
            ["{tar}", "--plot", "{out}"],
            "--plot needs matplotlib: pip install matplotlib",
        ),
    ],
)
def test_mistakes_are_one_line(
    run_cli: Any,
    assert_cli_error: Callable[..., str],
    data: Data,
    tmp_path: pathlib.Path,
    args: list[str],
    needle: str,
) -> None:
    names = {
        "tar": data.tar,
        "hdf5": data.hdf5,
        "missing": tmp_path / "missing",
        "out": tmp_path / "out.png",
    }
    argv = [a.format(**names) for a in args]
    env = _no_matplotlib(tmp_path) if "--plot" in argv else None
    result = run_cli("bench", *argv, env=env)
    assert_cli_error(result, needle)
    assert result.stdout == ""
    assert not (tmp_path / "out.png").exists()


def _shadow_env(tmp_path: pathlib.Path, package: str) -> dict[str, str]:
    """An environment where ``import PACKAGE`` fails as if it were not installed."""
    shadow = tmp_path / f"no-{package}"
    shadow.mkdir()
    (shadow / f"{package}.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{package}'\", name='{package}')\n"
    )
    path = os.pathsep.join(p for p in (os.fspath(shadow), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}


def test_bench_without_torch_names_the_extra(
    run_cli: Any, assert_cli_error: Callable[..., str], data: Data, tmp_path: pathlib.Path
) -> None:
    result = run_cli("bench", data.tar, env=_shadow_env(tmp_path, "torch"))
    line = assert_cli_error(
        result,
        "shardio bench needs PyTorch: pip install torch",
    )
    assert "internal error" not in line and result.stdout == ""


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "fifo", "device", "directory"])
def test_plot_never_replaces_anything_but_a_regular_file(
    run_cli: Any,
    assert_cli_error: Callable[..., str],
    data: Data,
    tmp_path: pathlib.Path,
    kind: str,
) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    out = tmp_path / "out.png"
    if kind == "symlink":
        out.symlink_to(target)
    elif kind == "dangling symlink":
        out.symlink_to(tmp_path / "nowhere.png")
    elif kind == "fifo":
        os.mkfifo(out)
    elif kind == "device":
        if os.geteuid() != 0:
            pytest.skip("mknod of a device needs root")
        os.mknod(out, 0o600 | __import__("stat").S_IFCHR, os.makedev(1, 3))  # like /dev/null
    else:
        out.mkdir()
    before = os.lstat(out)
    result = run_cli("bench", data.tar, "--compute-ms", "0", "--plot", out)
    line = assert_cli_error(result, f"--plot {out}")
    assert "regular file" in line or "is a directory" in line, line
    assert result.stdout == ""  # refused before the run
    after = os.lstat(out)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert target.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.png", "precious.txt"]


def test_plot_replaced_by_a_symlink_during_the_run_is_left_alone(
    data: Data, tmp_path: pathlib.Path
) -> None:
    """The check is made again just before the rename (the run takes minutes)."""
    from shardio.bench.plot import write_plot
    from shardio.errors import StorageError

    run = run_shardio(os.fspath(data.tar), BenchSettings(workers=0, batch_size=BATCH,
                                                          compute_ms=0.0))  # fmt: skip
    out = tmp_path / "out.png"
    write_plot([run], out)
    assert out.read_bytes().startswith(PNG_SIGNATURE)  # a regular file is replaced
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    out.unlink()
    out.symlink_to(target)
    with pytest.raises(StorageError, match="is a symlink, not a regular file"):
        write_plot([run], out)
    assert out.is_symlink() and target.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.png", "precious.txt"]
