"""Soak: flat memory, descriptors and threads over hundreds of epochs.

Two small datasets' worth of synthetic samples (random bytes, 4 classes) are written and
packed under a temporary directory of ``--workdir``: one read alone in stream mode, two read
as a 2-source ``MixedDataset`` in map mode. A child process (the training process, started
fresh so that the packing leaves nothing in it) reads an epoch of each, one after the other,
for ``--epochs`` epochs, through ``ds.loader(batch_size=32, num_workers=2)`` with persistent
workers and a ``PrometheusExporter`` on 127.0.0.1 (a free port, scraped once an epoch).
After each epoch it samples itself and each DataLoader worker from /proc (see
``benchmarks/soak.py``): RSS, anonymous RSS, PSS, USS, open descriptors, threads, and the
/dev/shm files mapped. The first ``--warmup`` epochs are not recorded.

The section "## Soak: flat memory over a long run" of RESULTS.md gets, per process, the
figures after warm-up and at the end, the least-squares slope (KiB per epoch, and MiB per
1,000 epochs), and the detector's verdict (``soak.judge``, the same one
``tests/integration/test_soak.py`` asserts with on a short run).

Usage: ``python benchmarks/bench_soak.py [--epochs 1000] [--warmup 50] [--samples 512]
[--size 2048] [--no-write]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import soak

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ME = os.path.abspath(__file__)
SECTION = "## Soak: flat memory over a long run"


def _write_files(src: str, prefix: str, files: int, size: int) -> None:
    rng = random.Random(prefix)
    for i in range(files):
        folder = os.path.join(src, f"c{i % 4}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{prefix}_{i:06d}.jpg"), "wb") as fh:
            fh.write(rng.randbytes(size))


def make_datasets(root: str, samples: int, size: int) -> list[str]:
    """Three packed datasets of ``samples`` samples of ``size`` bytes under ``root``: one for
    the plain loader, two for the mix (shards of 64 KiB, so each has several)."""
    from shardio.packing.run import PackOptions, pack

    out = []
    for name in ("plain", "mix-a", "mix-b"):
        src = os.path.join(root, f"src-{name}")
        _write_files(src, name, samples, size)
        dst = os.path.join(root, name)
        pack(src, dst, PackOptions(shard_format="tar", shard_size_bytes=64 << 10, durable=False))
        out.append(dst)
    return out


def _soak_child(argv: list[str]) -> int:
    """``bench_soak.py _soak PLAIN MIX_A,MIX_B RESULT EPOCHS WARMUP BATCH WORKERS``."""
    plain, mix, result = argv[0], argv[1].split(","), argv[2]
    epochs, warmup, batch, workers = (int(v) for v in argv[3:7])

    def progress(epoch: int, seconds: float) -> None:
        if (epoch + 1) % 50 == 0:
            print(f"epoch {epoch + 1}/{epochs}: {seconds:.0f} s", file=sys.stderr, flush=True)

    run = soak.soak(
        plain,
        mix,
        epochs=epochs,
        warmup=warmup,
        batch_size=batch,
        workers=workers,
        progress=progress,
    )
    with open(result, "w") as fh:
        json.dump(run.to_json(), fh)
    return 0


def _kib(value: float) -> str:
    return f"{value / 1024:,.1f}"


def report(run: soak.SoakRun, limits: soak.Limits) -> tuple[list[list[str]], list[str]]:
    """The table's rows (one per process) and the detector's findings."""
    rows = []
    for name, samples in run.series.items():
        g = {m: soak.growth(samples, m) for m in soak.METRICS}
        rss, anon = g["rss_kib"], g["anon_kib"]
        rows.append(
            [
                name,
                f"{_kib(rss.start)} → {_kib(rss.end)}",
                f"{rss.slope:+.2f}",
                f"{rss.slope * 1000 / 1024:+.2f}",
                f"{anon.slope:+.2f} ({anon.late_slope:+.2f})",
                f"{_kib(g['pss_kib'].start)} → {_kib(g['pss_kib'].end)}",
                f"{_kib(g['uss_kib'].start)} → {_kib(g['uss_kib'].end)}",
                f"{g['fds'].start:.0f} → {g['fds'].end:.0f}",
                f"{g['threads'].start:.0f} → {g['threads'].end:.0f}",
                f"{g['shm_maps'].start:.0f} → {g['shm_maps'].end:.0f}",
            ]
        )
    return rows, soak.judge(run.series, limits, restarts=run.restarts)


def main() -> int:
    if sys.argv[1:2] == ["_soak"]:
        return _soak_child(sys.argv[2:])
    parser = argparse.ArgumentParser(
        description="Soak: RSS, descriptors and threads of the training process and each "
        "DataLoader worker over hundreds of epochs (persistent workers, a mix, the "
        "Prometheus exporter on)."
    )
    parser.add_argument("--epochs", type=int, default=1000, help="epochs of each loader")
    parser.add_argument("--warmup", type=int, default=50, help="epochs not recorded")
    parser.add_argument("--samples", type=int, default=512, help="samples of each dataset")
    parser.add_argument("--size", type=int, default=2048, help="bytes of each sample")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2, help="workers of each loader")
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--json", help="also write the per-epoch samples to this file")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    for option in ("epochs", "samples", "size", "batch_size", "workers"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1")
    if not 0 <= args.warmup <= args.epochs - 6:
        parser.error("--warmup must be from 0 to --epochs - 6 (the detector needs 6 samples)")
    os.makedirs(args.workdir, exist_ok=True)
    common.hold_bench_lock(args.workdir)
    before = common.code_state(REPO)
    load_before = common.loadavg()
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="soak-") as root:
        plain, mix_a, mix_b = make_datasets(root, args.samples, args.size)
        result = os.path.join(root, "result.json")
        argv = [sys.executable, ME, "_soak", plain, f"{mix_a},{mix_b}", result]
        argv += [str(v) for v in (args.epochs, args.warmup, args.batch_size, args.workers)]
        print(shlex.join(argv), file=sys.stderr)
        proc = subprocess.run(argv, check=False, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"the soak child failed with exit code {proc.returncode}")
        with open(result) as fh:
            raw = json.load(fh)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(raw, fh)
    run = soak.SoakRun.from_json(raw)
    limits = soak.Limits()
    rows, problems = report(run, limits)
    recorded = args.epochs - args.warmup
    left = run.after_close
    verdict = (
        "**PASS**: no process grew (detector limits per process: RSS and anonymous RSS slope "
        f"over the second half under {limits.late_slope_kib_per_epoch:g} KiB/epoch, end - "
        f"start under {limits.growth_mib:g} MiB; descriptors, threads and /dev/shm maps: no "
        "growth)."
        if not problems
        else "**FAIL**: " + "; ".join(problems) + "."
    )
    body = "\n".join(
        [
            f"Run {datetime.date.today().isoformat()}: `python benchmarks/bench_soak.py "
            f"--epochs {args.epochs} --warmup {args.warmup} --samples {args.samples} "
            f"--size {args.size}` (load average before {load_before}, after "
            f"{common.loadavg()}).",
            "",
            common.code_line(before, common.code_state(REPO), "read"),
            "",
            f"{args.epochs} epochs of two loaders in one training process, one after the other: "
            f"a dataset of {args.samples:,} samples of {args.size:,} bytes in stream mode, and "
            f"a 2-source `MixedDataset` (map mode) of two more such datasets; "
            f"`ds.loader(batch_size={args.batch_size}, num_workers={args.workers})` with "
            "persistent workers, the ring transport, checksums verified; a "
            "`PrometheusExporter` on 127.0.0.1 (a free port, `interval_s=0.5`) scraped after "
            f"every epoch ({run.scrapes} scrapes). {run.samples:,} samples in "
            f"{run.wall_s:.0f} s ({run.wall_s / args.epochs * 1000:.0f} ms per epoch of both). "
            f"Sampled from /proc after each epoch; the first {args.warmup} epochs are warm-up, "
            f"the {recorded} after them are recorded. Start and end: medians of the first and "
            "last tenth of the samples (KiB shown as MiB); slope: least squares over every "
            "recorded epoch (second half in brackets for anonymous RSS).",
            "",
            common.markdown_table(
                [
                    "process",
                    "RSS MiB",
                    "RSS KiB/epoch",
                    "RSS MiB/1,000 epochs",
                    "anon RSS KiB/epoch (2nd half)",
                    "PSS MiB",
                    "USS MiB",
                    "fds",
                    "threads",
                    "/dev/shm maps",
                ],
                rows,
            ),
            "",
            f"Workers replaced during the run: {run.restarts}. After `loader.close()`: "
            f"{left['workers_left']} workers left, {left['threads']} threads and "
            f"{left['fds']} descriptors in the training process (before the loaders: "
            f"{run.before['threads']} and {run.before['fds']}), {left['dev_shm_left']} "
            "/dev/shm files named after its processes left behind.",
            "",
            verdict,
        ]
    )
    common.publish(body, SECTION, args)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
