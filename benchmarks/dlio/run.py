"""DLIO's resnet50 and unet3d workloads (MLPerf Storage), scaled: DLIO's readers against shardio.

For each workload (benchmarks/dlio/dlio_parts.py's WORKLOADS: sizes, batch and computation
time scaled to this machine), DLIO generates its own data (JPEG, npz) once into
``--workdir``, and ``shardio pack`` packs that tree into tar shards, so both readers read the
same bytes. Then, each run a fresh ``dlio_benchmark`` process of one rank with 2 read threads
(DataLoader workers), one epoch, caches dropped before it:

- DLIO's own reader of the format, and the shardio plug-in (benchmarks/dlio/shardio_reader.py:
  ``ShardDataset``, every byte verified, parsed as DLIO's reader parses the file), each with
  the scaled computation time (AU as MLPerf Storage reads it) and with none (I/O bound);
- on the local disk the plug-in's NullReader too: no I/O, no computation (DLIO's own cost);
- the same reader runs on a private MooseFS bed (``scripts/pfs/moosefs.sh``, bench_pfs.Bed:
  2 chunkservers, one copy; always taken down, also on error, Ctrl-C or SIGTERM), with the
  metadata-server requests of each run from the client's counters (``MOUNT/.stats``).

Samples/s and AU come from DLIO's own ``summary.json``. The section "## DLIO (MLPerf Storage
workloads, scaled)" of benchmarks/RESULTS.md is rewritten; other sections are kept.

Usage (root: the bed and drop_caches; the venv from benchmarks/dlio/install.sh)::

    sudo .venv/bin/python benchmarks/dlio/run.py [--venv .venv-dlio] [--fs local,bed]
        [--workloads resnet50,unet3d] [--repeat 1] [--no-write]

Not a test: it measures and reports, and asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
REPO = os.path.dirname(BENCH)
sys.path[:0] = [HERE, BENCH]

import common  # noqa: E402
import dlio_parts  # noqa: E402
from bench_pfs import Bed  # noqa: E402

SECTION = "## DLIO (MLPerf Storage workloads, scaled)"
READ_THREADS = 2
SHARD_SIZE = "64MiB"
READER_CLASSES = {
    "dlio": None,
    "shardio": "shardio_reader.ShardioReader",
    "null": "shardio_reader.NullReader",
}
MDS_COUNTER = "master.packets_sent"


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(f"terminated by signal {signum}")  # unwinds: the bed is taken down


def _dlio_env(dataset_root: str) -> dict[str, str]:
    # The stub first: DLIO imports tensorflow at start-up (see stub/tensorflow/__init__.py);
    # REPO so that this checkout's shardio is the one measured.
    path = os.pathsep.join([os.path.join(HERE, "stub"), HERE, REPO])
    return dict(os.environ, PYTHONPATH=path, **{dlio_parts.DATASET_ENV: dataset_root})


def _prepare(w: dlio_parts.Workload, args: argparse.Namespace) -> tuple[str, str]:
    """DLIO's generated tree and its shardio pack under the workdir (reused when stamped)."""
    base = os.path.join(args.workdir, f"{w.name}-f{w.files}-r{w.record_length}")
    data, packed = os.path.join(base, "data"), os.path.join(base, "shardio")
    if not os.path.exists(data + ".done"):
        common.remove_path(data)
        gen_out = os.path.join(base, "generate")
        common.remove_path(gen_out)
        os.makedirs(gen_out)
        argv = [
            os.path.join(args.venv, "bin", "dlio_benchmark"),
            *dlio_parts.dlio_overrides(
                w, data, read_threads=READ_THREADS, generate=True, output_dir=gen_out
            ),
        ]
        print("generate:", shlex.join(argv), file=sys.stderr)
        subprocess.run(argv, env=_dlio_env(packed), cwd=gen_out, check=True, timeout=900,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        open(data + ".done", "w").close()
        common.remove_path(packed + ".done")
    if not os.path.exists(packed + ".done"):
        common.remove_path(packed)
        argv = [os.path.join(args.venv, "bin", "shardio"), "pack", os.path.join(data, "train"),
                os.path.join(packed, "train"), "--labels", "none", "--shard-size", SHARD_SIZE,
                "--no-progress"]  # fmt: skip
        print("pack:", shlex.join(argv), file=sys.stderr)
        subprocess.run(argv, env=_dlio_env(packed), check=True, timeout=900,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        open(packed + ".done", "w").close()
    return data, packed


def _run_once(
    w: dlio_parts.Workload,
    reader: str,
    compute: bool,
    *,
    fs: str,
    data: str,
    packed: str,
    bed: Bed | None,
    args: argparse.Namespace,
) -> dlio_parts.RunRecord:
    out = os.path.join(args.workdir, "runs", f"{fs}-{w.name}-{reader}-{int(compute)}")
    common.remove_path(out)
    os.makedirs(out)
    argv = [
        os.path.join(args.venv, "bin", "dlio_benchmark"),
        *dlio_parts.dlio_overrides(
            w, data, read_threads=READ_THREADS, reader_classname=READER_CLASSES[reader],
            computation_time_s=None if compute else 0.0, output_dir=out,
        ),
    ]  # fmt: skip
    if reader == "dlio" and compute:
        args.commands.setdefault(w.name, argv)
    common.drop_caches()
    before = bed.stats() if bed else None
    run = common.run_child(argv, env=_dlio_env(packed), cwd=out, timeout_s=args.timeout_s)
    after = bed.stats() if bed else None
    mds = after[MDS_COUNTER] - before[MDS_COUNTER] if before and after else None
    figures, error = None, ""
    if run.returncode != 0:
        error = "timed out" if run.timed_out else f"exit {run.returncode}"
        error += ": " + " ".join(run.stderr_tail.strip().splitlines()[-1:])[-200:]
    else:
        try:
            figures = dlio_parts.read_summary(os.path.join(out, "summary.json"))
        except ValueError as exc:
            error = str(exc)
    record = dlio_parts.RunRecord(
        workload=w.name, fs=fs, reader=reader, compute=compute, figures=figures,
        wall_s=run.wall_s, cpu_s=run.user_s + run.sys_s, mds_requests=mds, error=error,
    )  # fmt: skip
    print(f"{fs} {w.name} {reader} compute={compute}: "
          f"{figures or error} wall {run.wall_s:.1f} s, mds {mds}", file=sys.stderr)  # fmt: skip
    return record


def _median_run(runs: Sequence[dlio_parts.RunRecord]) -> dlio_parts.RunRecord:
    """The run with the median samples/s (a failed one if any failed: never hidden)."""
    failed = [r for r in runs if r.figures is None]
    if failed:
        return failed[0]
    ranked = sorted(runs, key=lambda r: r.figures.samples_per_s if r.figures else 0.0)
    return ranked[(len(ranked) - 1) // 2]


def _plan(fs: str) -> list[tuple[str, bool]]:
    readers = [("dlio", True), ("shardio", True), ("dlio", False), ("shardio", False)]
    return [*readers, ("null", False)] if fs == "local" else readers


def _measure(
    workloads: Sequence[dlio_parts.Workload],
    paths: dict[str, tuple[str, str]],
    fs: str,
    bed: Bed | None,
    args: argparse.Namespace,
) -> list[dlio_parts.RunRecord]:
    records = []
    for w in workloads:
        data, packed = paths[w.name]
        plan = _plan(fs)
        rounds: dict[tuple[str, bool], list[dlio_parts.RunRecord]] = {p: [] for p in plan}
        for r in range(args.repeat):
            shift = r % len(plan)  # round-robin, so drift spreads over the readers
            for reader, compute in plan[shift:] + plan[:shift]:
                rounds[reader, compute].append(_run_once(
                    w, reader, compute, fs=fs, data=data, packed=packed, bed=bed, args=args,
                ))  # fmt: skip
        records += [_median_run(rounds[p]) for p in plan]
    return records


def _on_bed(
    workloads: Sequence[dlio_parts.Workload],
    paths: dict[str, tuple[str, str]],
    args: argparse.Namespace,
    facts: dict[str, Any],
) -> list[dlio_parts.RunRecord]:
    bed_dir = args.bed_dir or f"/tmp/shardio-bench-dlio-{os.getpid()}"
    bed = Bed(bed_dir, chunkservers=2, ioretries=3)
    facts["bed_argv"] = shlex.join(bed.up_argv)
    try:
        print("bed:", facts["bed_argv"], file=sys.stderr)
        bed.up()
        on_bed: dict[str, tuple[str, str]] = {}
        for w in workloads:
            data, packed = paths[w.name]
            dest = os.path.join(bed.mount, w.name)
            os.makedirs(dest)
            subprocess.run(["cp", "-r", data, packed, dest], check=True, timeout=900)
            on_bed[w.name] = (os.path.join(dest, "data"), os.path.join(dest, "shardio"))
        facts["mfs_version"] = common.first_line(
            ["dpkg-query", "-W", "-f", "${Version}\\n", "moosefs-client"]
        )
        return _measure(workloads, on_bed, "bed", bed, args)
    finally:
        bed.down_reported()


def _versions(venv: str) -> str:
    code = (
        "from importlib.metadata import version as v; import sys; "
        "print(f'Python {sys.version.split()[0]}, ' + ', '.join(f'{p} {v(p)}' for p in "
        "('dlio_benchmark', 'torch', 'numpy', 'pillow', 'h5py', 'shardio-hpc')))"
    )
    return common.first_line([os.path.join(venv, "bin", "python"), "-c", code])


def _report(
    records: Sequence[dlio_parts.RunRecord],
    workloads: Sequence[dlio_parts.Workload],
    args: argparse.Namespace,
    facts: dict[str, Any],
) -> str:
    samples = {w.name: w.files for w in workloads}
    how_many = f"the median run of {args.repeat}" if args.repeat > 1 else "one run each"
    lines = [
        f"Run {facts['started']} ({facts['elapsed_s'] / 60:.1f} min): "
        f"`{shlex.join(facts['argv'])}`. {facts['versions']} (venv from "
        f"`benchmarks/dlio/install.sh {args.venv}`). {facts['code']}",
        "",
        f"Load average (1, 5, 15 min) before: {facts['load_before']}; after: "
        f"{facts['load_after']} (this machine has 2 cores{args.load_note}).",
        "",
        "DLIO runs one rank (no mpirun), 2 read threads (PyTorch DataLoader workers), one "
        "epoch per `dlio_benchmark` process, caches dropped before each. The data are DLIO's "
        "own (`workflow.generate_data`), packed with "
        f"`shardio pack DATA/train OUT/train --labels none --shard-size {SHARD_SIZE}`: both "
        "readers read the same bytes and parse them the same way (a JPEG decoded by PIL, an "
        "npz's array loaded); the shardio plug-in reads through `ShardDataset` with every "
        "byte verified (xxh3-64) and its key checked. DLIO still lists the loose tree's "
        "directory to number its samples (a few metadata requests in every run); the plug-in "
        "never opens those files. Samples/s, AU and MB/s are DLIO's (`summary.json`; its MB/s "
        "counts `record_length` per sample, not the bytes read). Figures are "
        f"{how_many}. CPU s: user + system time of the DLIO process and its workers, start-up "
        '(~3 s of imports) included; the bed\'s daemons not. "computation: none" runs have no '
        "simulated training step (I/O bound; AU is 0 "
        'by definition); "scaled" runs sleep the scaled computation time per batch.',
        "",
        "Scaling (DLIO 2.0.0's workload files, with `++workload...` overrides; PyTorch "
        "framework and loader; 2 read threads instead of 8 and 4):",
        "",
        *[f"- {w.name}: {w.scaling}." for w in workloads],
        "",
    ]
    if "bed_argv" in facts:
        lines += [
            f"The bed: `{facts['bed_argv']}` (MooseFS {facts.get('mfs_version', '?')}), data "
            "copied onto it with `cp -r`. MDS requests: the client's "
            f"`{MDS_COUNTER}` over the whole process (`MOUNT/.stats`), per 1,000 samples.",
            "",
        ]
    lines.append(dlio_parts.render_tables(records, samples))
    lines += [
        "Commands: DLIO's reader with the scaled computation, per workload; the shardio runs "
        "add `++workload.reader.reader_classname=shardio_reader.ShardioReader`, the no-I/O "
        "run `...=shardio_reader.NullReader`, the runs without computation "
        "`++workload.train.computation_time=0.0`; the bed's differ in the paths only "
        f"(`{dlio_parts.DATASET_ENV}`: the directory holding the packed `train/`).",
        "",
        "```",
    ]
    env = f"PYTHONPATH=benchmarks/dlio/stub:benchmarks/dlio:. {dlio_parts.DATASET_ENV}=PACKED"
    lines += [f"{env} {shlex.join(argv)}" for argv in args.commands.values()]
    lines.append("```")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the DLIO workloads and update RESULTS.md."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=os.path.join(REPO, ".venv-dlio"), help="from install.sh")
    parser.add_argument("--fs", default="local,bed", help="local,bed")
    parser.add_argument("--workloads", default=",".join(dlio_parts.WORKLOADS))
    parser.add_argument("--files", type=int, default=0, help="samples (0: the workload's)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per configuration")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per DLIO run")
    parser.add_argument("--bed-dir", default="", help="new or empty (default: /tmp/...)")
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench", "dlio"))
    parser.add_argument("--out", default=os.path.join(BENCH, "RESULTS.md"))
    parser.add_argument("--load-note", default="", help="appended to the load-average line")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    fs_list = [f for f in args.fs.split(",") if f]
    if not fs_list or set(fs_list) - {"local", "bed"}:
        parser.error(f"--fs: local and/or bed, not {args.fs!r}")
    names = [n for n in args.workloads.split(",") if n]
    if not names or set(names) - set(dlio_parts.WORKLOADS):
        parser.error(f"--workloads: some of {', '.join(dlio_parts.WORKLOADS)}")
    if not 1 <= args.repeat <= 20:
        parser.error("--repeat: 1 to 20")
    if not 0 <= args.files <= 100_000:
        parser.error("--files: 1 to 100000 (0: the workload's)")
    if not 1 <= args.timeout_s <= 3600:
        parser.error("--timeout-s: 1 to 3600")
    if not os.access(os.path.join(args.venv, "bin", "dlio_benchmark"), os.X_OK):
        parser.error(f"no DLIO in {args.venv}: run benchmarks/dlio/install.sh {args.venv}")
    if os.geteuid() != 0:
        parser.error("needs root: drop_caches and the MooseFS bed")
    args.workdir = os.path.abspath(args.workdir)
    args.load_note = f"; {args.load_note}" if args.load_note else ""
    args.commands = {}
    common.hold_bench_lock(args.workdir)
    signal.signal(signal.SIGTERM, _sigterm)

    workloads = [dlio_parts.WORKLOADS[n] for n in names]
    if args.files:
        workloads = [replace(w, files=args.files) for w in workloads]
    facts: dict[str, Any] = {
        "argv": [sys.executable, os.path.abspath(__file__), *argv],
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_before": common.loadavg(),
        "versions": _versions(args.venv),
    }
    t_start = time.perf_counter()
    code_before = common.code_state(REPO)
    paths = {w.name: _prepare(w, args) for w in workloads}
    records: list[dlio_parts.RunRecord] = []
    if "local" in fs_list:
        records += _measure(workloads, paths, "local", None, args)
    if "bed" in fs_list:
        records += _on_bed(workloads, paths, args, facts)
    records.sort(key=lambda r: names.index(r.workload))  # stable: local rows before bed's
    facts.update(
        elapsed_s=time.perf_counter() - t_start,
        load_after=common.loadavg(),
        code=common.code_line(code_before, common.code_state(REPO), "read"),
    )
    body = _report(records, workloads, args, facts)
    print(body)
    if not args.no_write:
        common.update_section(args.out, SECTION, body, common.results_header(args.workdir))
        print(f"wrote {SECTION!r} into {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
