"""A short soak: memory, descriptors and threads stay flat over many epochs.

The same run as ``benchmarks/bench_soak.py``, shorter and smaller (30 epochs of tiny
datasets): a plain loader in stream mode and a 2-source mix in map mode, persistent
workers, the Prometheus exporter on and scraped each epoch, the training process and every
worker sampled from /proc after each epoch. ``soak.judge`` (the benchmark's detector) must
find nothing; injected leaks, in the training loop and in a worker, must be found, so the
test can fail.
"""

from __future__ import annotations

import json
import pathlib
import random
import subprocess
import sys
from typing import Any

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import soak  # noqa: E402

pytest.importorskip("torch")
pytest.importorskip("prometheus_client")

EPOCHS, WARMUP = 30, 8


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    from shardio.packing.run import PackOptions, pack

    root = tmp_path_factory.mktemp("soak")
    out = []
    for name in ("plain", "mix-a", "mix-b"):
        rng = random.Random(name)
        src = root / f"src-{name}"
        for i in range(128):
            folder = src / f"c{i % 4}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{name}_{i:04d}.jpg").write_bytes(rng.randbytes(1024))
        pack(str(src), str(root / name), PackOptions(shard_size_bytes=48 << 10, durable=False))
        out.append(str(root / name))
    return out


# The soak runs in a fresh interpreter, as benchmarks/bench_soak.py runs it: in a long-lived
# pytest worker the heap holds pages freed by earlier tests, which a leak fills before the RSS
# moves, so a real leak could go unseen (and the test pass by luck).
_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import soak
from shardio import MixedDataset

datasets, leak = json.loads(sys.argv[2]), sys.argv[3] == "leak"
kept, in_worker = [], []
if leak:  # 16 KiB a batch in the training loop; 32 KiB a batch in the mix's forked workers
    getitems = MixedDataset.__getitems__

    def leaky_getitems(self, positions):
        in_worker.append(b"\\x01" * (32 << 10))
        return getitems(self, positions)

    MixedDataset.__getitems__ = leaky_getitems
run = soak.soak(
    datasets[0], datasets[1:], epochs=int(sys.argv[4]), warmup=int(sys.argv[5]), batch_size=16,
    on_batch=(lambda batch: kept.append(b"\\x01" * (16 << 10))) if leak else None,
)
print(json.dumps({
    "problems": soak.judge(run.series, soak.Limits(), restarts=run.restarts),
    "samples": run.samples, "scrapes": run.scrapes,
    "series": {name: len(s) for name, s in run.series.items()},
    "before": run.before, "after_close": run.after_close,
}))
"""


def _soak(datasets: list[str], leak: bool = False) -> dict[str, Any]:
    argv = [sys.executable, "-c", _CHILD, str(BENCH), json.dumps(datasets)]
    argv += ["leak" if leak else "clean", str(EPOCHS), str(WARMUP)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_long_run_stays_flat(datasets: list[str]) -> None:
    run = _soak(datasets)
    assert run["samples"] == EPOCHS * 3 * 128
    assert run["scrapes"] == EPOCHS
    assert run["series"] == {
        name: EPOCHS - WARMUP
        for name in (
            "training process",
            "plain worker 0",
            "plain worker 1",
            "mix worker 0",
            "mix worker 1",
        )
    }
    assert run["problems"] == []
    # close() leaves no worker, thread, descriptor or shared-memory file behind.
    assert run["after_close"]["workers_left"] == 0
    assert run["after_close"]["threads"] <= run["before"]["threads"]
    assert run["after_close"]["fds"] <= run["before"]["fds"]
    assert run["after_close"]["dev_shm_left"] == 0


def test_the_detector_finds_leaks_in_the_loop_and_in_a_worker(datasets: list[str]) -> None:
    problems = _soak(datasets, leak=True)["problems"]
    assert any(p.startswith("training process: RSS grows") for p in problems), problems
    assert any(p.startswith("mix worker 0: anonymous RSS grows") for p in problems), problems
    assert any(p.startswith("mix worker 1: anonymous RSS grows") for p in problems), problems
    assert not any(p.startswith("plain worker") for p in problems), problems


def _series(**per_epoch: float) -> soak.Series:
    """40 epochs of a process that grows by ``per_epoch`` (KiB or counts) each, with noise."""
    rng = random.Random(0)
    out = []
    for e in range(40):
        noise = rng.uniform(-50, 50)
        values = {m: 1000.0 + per_epoch.get(m, 0.0) * e + noise for m in soak.METRICS}
        for m in ("fds", "threads", "shm_maps"):
            values[m] = 10 + int(per_epoch.get(m, 0.0) * e)
        out.append((e, soak.ProcSample(**{m: int(v) for m, v in values.items()})))
    return out


def test_the_detector_on_made_up_series() -> None:
    limits = soak.Limits()
    assert soak.judge({"p": _series()}, limits) == []
    assert soak.judge({"p": _series(uss_kib=500, pss_kib=500)}, limits) == []  # not judged
    leaking = soak.judge({"p": _series(rss_kib=64, anon_kib=64)}, limits)
    assert [p.split(" grows ")[0] for p in leaking] == ["p: RSS", "p: anonymous RSS"], leaking
    assert all(p.endswith("KiB/epoch over the second half (limit 32)") for p in leaking)
    # Slow growth under the slope limit that still adds up over the run.
    slow = soak.judge({"p": _series(rss_kib=30, anon_kib=0)}, soak.Limits(growth_mib=0.5))
    assert slow == ["p: RSS grew 1.1 MiB from start to end (limit 0.5)"]
    assert soak.judge({"p": _series(fds=0.25)}, limits) == [
        "p: fds grew from 10 to 19 (at least, over the last tenth; limit +0)"
    ]
    assert soak.judge({"p": _series(threads=0.1)}, limits)[0].startswith("p: threads grew")
    assert soak.judge({"p": _series()}, limits, restarts=2) == [
        "2 DataLoader worker(s) replaced during the run"
    ]
    assert soak.judge({"p": _series()[:5]}, limits) == ["p: 5 samples, too few to judge"]
    assert soak.slope([0, 1, 2], [5, 7, 9]) == pytest.approx(2.0)
    assert soak.slope([1, 1], [0, 5]) == 0.0
