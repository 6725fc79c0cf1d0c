"""Pack throughput: shardio pack against tar and the peers' writers, on one generated tree.

Every configuration runs as its own child process, from a cold page cache, ``--repeat``
times (round-robin, so drift spreads over all of them), and its output is deleted after each
run. Reported per configuration: median wall time, MB/s and files/s of source payload
(1 MB = 10^6 bytes), throughput ratio against webdataset's ShardWriter, wall-time ratio
against ``tar cf`` (with and without a final sync) and peak RSS. The section
"## Pack throughput" of benchmarks/RESULTS.md is rewritten; other sections are kept.

Usage::

    .venv/bin/python benchmarks/bench_pack.py [--files 20000] [--mean-kb 110] [--repeat 3]
        [--workdir .bench] [--out benchmarks/RESULTS.md] [--only NAME,...]

Not a test: it measures and reports, and asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)
GiB = 1024**3
SECTION = "## Pack throughput"
TARGET_WORKERS2_VS_WDS = 2.0
TARGET_WORKERS1_VS_TAR = 1.3
PEER_UNAVAILABLE = 3  # exit code of a peer child whose library cannot be imported


# --------------------------------------------------------------------------------------------
# Peer writers, each run in its own child process: ``bench_pack.py _peer NAME SRC DST BYTES``.
# They do what a user of that library would write: walk the tree, open().read() each file,
# key = relative path without extension, "jpeg" = the bytes, "cls" = class index.
# --------------------------------------------------------------------------------------------


def _walk_samples(src: str) -> tuple[list[str], dict[str, int]]:
    rels: list[str] = []
    for root, dirs, files in os.walk(src):
        dirs.sort()
        rel_root = os.path.relpath(root, src)
        rels.extend(os.path.join(rel_root, f) if rel_root != "." else f for f in sorted(files))
    classes = sorted({os.path.basename(os.path.dirname(r)) for r in rels})
    return rels, {c: i for i, c in enumerate(classes)}


def _tree_samples(src: str, walked: tuple[list[str], dict[str, int]]) -> Iterator[dict[str, Any]]:
    """The samples a user of a writer builds: the file read whole, its class index."""
    rels, class_ids = walked
    for rel in rels:
        with open(os.path.join(src, rel), "rb") as fh:
            data = fh.read()
        yield {
            "__key__": os.path.splitext(rel)[0],
            "jpeg": data,
            "cls": class_ids[os.path.basename(os.path.dirname(rel))],
        }


def _peer_wds(src: str, dst: str, shard_bytes: int) -> None:
    try:
        import webdataset as wds
    except ImportError as exc:
        print(f"webdataset unavailable: {exc}", file=sys.stderr)
        sys.exit(PEER_UNAVAILABLE)
    os.makedirs(dst, exist_ok=True)
    pattern = os.path.join(dst, "shard-%06d.tar")
    with wds.ShardWriter(pattern, maxsize=shard_bytes, verbose=0) as sink:
        for sample in _tree_samples(src, _walk_samples(src)):
            sink.write(sample)


def _import_mds_writer() -> type:
    """Import streaming's MDSWriter without running ``streaming/__init__`` (see
    :func:`common.import_streaming`)."""
    common.import_streaming()
    from streaming.base.format.mds.writer import MDSWriter

    return MDSWriter  # type: ignore[no-any-return]


def _peer_mds(src: str, dst: str, shard_bytes: int) -> None:
    try:
        mds_writer = _import_mds_writer()
    except Exception as exc:  # any import failure means "unavailable"
        print(f"mosaicml-streaming unavailable: {exc!r}", file=sys.stderr)
        sys.exit(PEER_UNAVAILABLE)
    rels, class_ids = _walk_samples(src)
    with mds_writer(
        out=dst, columns={"jpeg": "bytes", "cls": "int"}, size_limit=shard_bytes
    ) as writer:
        for rel in rels:
            with open(os.path.join(src, rel), "rb") as fh:
                data = fh.read()
            writer.write({"jpeg": data, "cls": class_ids[os.path.basename(os.path.dirname(rel))]})


def _peer_shardio(src: str, dst: str, shard_bytes: int) -> None:
    """shardio's own ShardWriter in the peers' loop: samples written from code."""
    from shardio import ShardWriter

    walked = _walk_samples(src)
    with ShardWriter(dst, format="tar", shard_size=shard_bytes, classes=list(walked[1])) as w:
        for sample in _tree_samples(src, walked):
            w.write(sample)


_PEERS: dict[str, Callable[[str, str, int], None]] = {
    "wds": _peer_wds,
    "mds": _peer_mds,
    "shardio-writer": _peer_shardio,
}


# --------------------------------------------------------------------------------------------
# The benchmark.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One measured configuration."""

    name: str
    label: str
    argv: Callable[[str, str], list[str]]  # (src, out) -> argv
    out_is_dir: bool = True


@dataclass
class Outcome:
    """The runs of one configuration."""

    config: Config
    walls: list[float] = field(default_factory=list)
    max_rss: list[int] = field(default_factory=list)
    tree_rss: list[int] = field(default_factory=list)
    out_bytes: list[int] = field(default_factory=list)
    status: str = "ok"  # ok | failed | unavailable
    note: str = ""

    @property
    def wall(self) -> float:
        return common.median(self.walls)


def _configs(shard_size: str, shard_bytes: int) -> list[Config]:
    py = sys.executable
    shardio = os.path.join(VENV_BIN, "shardio")
    me = os.path.abspath(__file__)

    def shardio_pack(fmt: str, workers: int) -> Callable[[str, str], list[str]]:
        return lambda src, out: [
            shardio,
            "pack",
            src,
            out,
            "--format",
            fmt,
            "--shard-size",
            shard_size,
            "--workers",
            str(workers),
            "--no-progress",
        ]

    def peer(name: str) -> Callable[[str, str], list[str]]:
        return lambda src, out: [py, me, "_peer", name, src, out, str(shard_bytes)]

    return [
        Config(
            "tar",
            "`tar cf` (floor, no sync)",
            lambda src, out: ["tar", "cf", out, "-C", src, "."],
            out_is_dir=False,
        ),
        Config(
            "tar-sync",
            "`tar cf` + `sync FILE` (floor, durable)",
            lambda src, out: ["sh", "-c", 'tar cf "$0" -C "$1" . && sync "$0"', out, src],
            out_is_dir=False,
        ),
        Config("shardio-tar-w1", "shardio pack tar, 1 worker", shardio_pack("tar", 1)),
        Config("shardio-tar-w2", "shardio pack tar, 2 workers", shardio_pack("tar", 2)),
        Config("shardio-hdf5-w1", "shardio pack hdf5, 1 worker", shardio_pack("hdf5", 1)),
        Config("shardio-hdf5-w2", "shardio pack hdf5, 2 workers", shardio_pack("hdf5", 2)),
        Config(
            "shardio-writer",
            "shardio `ShardWriter` from code, tar (1 process)",
            peer("shardio-writer"),
        ),
        Config("wds", "webdataset `ShardWriter` (1 process)", peer("wds")),
        Config("mds", "streaming `MDSWriter` (1 process)", peer("mds")),
    ]


def _ensure_tree(args: argparse.Namespace) -> str:
    name = f"tree-f{args.files}-kb{args.mean_kb:g}-c{args.classes}"
    src = os.path.join(args.workdir, name)
    stamp = src + ".done"
    if os.path.exists(stamp) and not args.regen:
        return src
    common.remove_path(src)
    common.remove_path(stamp)
    argv = [
        sys.executable,
        os.path.join(REPO, "scripts", "gen_imagenet.py"),
        src,
        "--files",
        str(args.files),
        "--classes",
        str(args.classes),
        "--mean-kb",
        str(args.mean_kb),
        "--quiet",
    ]
    print("generating", shlex.join(argv), file=sys.stderr)
    run = common.run_child(argv)
    if run.returncode != 0:
        raise SystemExit(f"generating the tree failed:\n{run.stderr_tail}")
    with open(stamp, "w") as fh:
        fh.write(shlex.join(argv) + "\n")
    return src


def _shell(argv: Sequence[str]) -> str:
    return shlex.join(argv).replace(REPO + "/", "")


def _measure(
    configs: Sequence[Config], src: str, workdir: str, repeat: int
) -> tuple[list[Outcome], bool]:
    outcomes = [Outcome(c) for c in configs]
    cold = True
    for rep in range(repeat):
        for outcome in outcomes:
            if outcome.status != "ok":
                continue
            cfg = outcome.config
            out = os.path.join(workdir, f"out-{cfg.name}" + ("" if cfg.out_is_dir else ".tar"))
            common.remove_path(out)
            cold = common.drop_caches() and cold
            run = common.run_child(cfg.argv(src, out))
            size = common.path_bytes(out) if os.path.exists(out) else 0
            common.remove_path(out)
            if run.returncode == PEER_UNAVAILABLE and cfg.name in _PEERS:
                outcome.status = "unavailable"
                outcome.note = run.stderr_tail.strip().splitlines()[-1]
            elif run.returncode != 0:
                outcome.status = "failed"
                outcome.note = f"exit {run.returncode}: " + " ".join(
                    run.stderr_tail.strip().splitlines()[-1:]
                )
            else:
                outcome.walls.append(run.wall_s)
                outcome.max_rss.append(run.max_rss_bytes)
                outcome.tree_rss.append(run.peak_tree_rss_bytes)
                outcome.out_bytes.append(size)
            print(
                f"[{rep + 1}/{repeat}] {cfg.name:16s} {run.wall_s:7.2f} s  rc={run.returncode}  "
                f"rss={run.max_rss_bytes / common.MiB:.0f} MiB  out={size / 1e9:.2f} GB",
                file=sys.stderr,
            )
    return outcomes, cold


def _find(outcomes: Sequence[Outcome], name: str) -> Outcome | None:
    for o in outcomes:
        if o.config.name == name and o.status == "ok" and o.walls:
            return o
    return None


def _verdict(ok: bool) -> str:
    return "**PASS**" if ok else "**FAIL**"


def _report(
    outcomes: Sequence[Outcome],
    *,
    args: argparse.Namespace,
    src: str,
    num_files: int,
    payload: int,
    cold: bool,
    started: str,
    load_before: str,
    load_after: str,
    code_before: common.CodeState,
    code_after: common.CodeState,
) -> str:
    wds = _find(outcomes, "wds")
    tar = _find(outcomes, "tar")
    tar_sync = _find(outcomes, "tar-sync")
    rows = []
    for o in outcomes:
        if o.status != "ok" or not o.walls:
            rows.append([o.config.label, o.status, "-", "-", "-", "-", "-", "-", "-"])
            continue
        wall = o.wall
        rows.append(
            [
                o.config.label,
                f"{wall:.2f} ({min(o.walls):.2f}-{max(o.walls):.2f})",
                f"{payload / 1e6 / wall:.0f}",
                f"{num_files / wall:.0f}",
                common.fmt_ratio(wds.wall / wall) if wds else "n/a",
                common.fmt_ratio(wall / tar.wall) if tar else "n/a",
                common.fmt_ratio(wall / tar_sync.wall) if tar_sync else "n/a",
                f"{max(o.max_rss) / common.MiB:.0f}",
                f"{max(o.tree_rss) / common.MiB:.0f}",
            ]
        )
    table = common.markdown_table(
        [
            "configuration",
            "wall s, median (min-max)",
            "MB/s",
            "files/s",
            "throughput vs wds ShardWriter",
            "wall vs `tar cf`",
            "wall vs `tar cf`+sync",
            "peak RSS MiB (largest process)",
            "peak RSS MiB (process tree, sampled)",
        ],
        rows,
    )

    targets = []
    for fmt in ("tar", "hdf5"):
        o = _find(outcomes, f"shardio-{fmt}-w2")
        if o and wds:
            ratio = wds.wall / o.wall
            targets.append(
                f"- shardio {fmt}, 2 workers ≥ {TARGET_WORKERS2_VS_WDS:g}x webdataset ShardWriter "
                f"throughput: {ratio:.3f}x → {_verdict(ratio >= TARGET_WORKERS2_VS_WDS)}"
            )
        else:
            targets.append(f"- shardio {fmt}, 2 workers vs webdataset: not measured")
    for fmt in ("tar", "hdf5"):
        o = _find(outcomes, f"shardio-{fmt}-w1")
        for floor, floor_name in ((tar, "`tar cf`"), (tar_sync, "`tar cf` + sync")):
            if o and floor:
                ratio = o.wall / floor.wall
                targets.append(
                    f"- shardio {fmt}, 1 worker wall ≤ {TARGET_WORKERS1_VS_TAR:g}x {floor_name}: "
                    f"{ratio:.3f}x → {_verdict(ratio <= TARGET_WORKERS1_VS_TAR)}"
                )

    notes = [f"- {o.config.label}: {o.status} — {o.note}" for o in outcomes if o.status != "ok"]
    raw = [
        f"- {o.config.name}: "
        + ", ".join(f"{w:.2f}" for w in o.walls)
        + f" s; output {common.median(o.out_bytes) / 1e9:.3f} GB"
        for o in outcomes
        if o.walls
    ]
    commands = [_shell(o.config.argv(src, "OUT")) for o in outcomes]
    versions = ", ".join(
        f"{n} {common.package_version(n)}"
        for n in ("shardio", "webdataset", "mosaicml-streaming", "numpy", "h5py", "xxhash", "torch")
    )
    cache = (
        "cold: `sync; echo 3 > /proc/sys/vm/drop_caches` before every run"
        if cold
        else "**warm**: dropping caches was not permitted (not root), so the source was "
        "(partly) in the page cache and the figures overstate cold throughput"
    )
    argv = [
        ".venv/bin/python",
        "benchmarks/bench_pack.py",
        "--files",
        str(args.files),
        "--mean-kb",
        f"{args.mean_kb:g}",
        "--repeat",
        str(args.repeat),
    ]
    code = common.code_line(code_before, code_after, "pack")
    parts = [
        f"Run {started}; {versions}; `{common.first_line(['tar', '--version'])}`.",
        "",
        code,
        "",
        f"Data: `scripts/gen_imagenet.py --files {args.files} --classes {args.classes} "
        f"--mean-kb {args.mean_kb:g}`: {num_files} real JPEGs in train/val class directories, "
        f"{payload / 1e9:.3f} GB of payload (MB = 10^6 bytes of source payload; MB/s and "
        f"files/s are payload / median wall). Shard size {args.shard_size_bytes / GiB:g} GiB "
        f"for every writer. Each configuration is a separate child process, run "
        f"{args.repeat}x round-robin; cache: {cache}; the output is deleted after each "
        f"run. Load average before / after: {load_before} / {load_after}.",
        "",
        table,
        "",
        "Throughput vs wds = wds median wall / this median wall (higher is better); wall vs "
        "tar = this median wall / tar's (lower is better). shardio fsyncs every shard, index "
        "and manifest before publishing it; `tar cf`, webdataset's ShardWriter and MDSWriter "
        "do not sync, so the `tar cf` + `sync FILE` row (fsync of the archive) is the fair "
        "durable floor. Peak RSS (largest process) is the kernel's ru_maxrss from wait4; the "
        "tree figure sums RSS of all live processes of the run every 0.1 s (shared pages "
        "count once per process).",
        "",
        "Targets:",
        "",
        *targets,
    ]
    if notes:
        parts += ["", "Not measured:", "", *notes]
    parts += [
        "",
        "Raw wall times (s), in run order:",
        "",
        *raw,
        "",
        "Reproduce (peers: `.venv/bin/pip install torch==2.13.0 mosaicml-streaming`):",
        "",
        "```",
        shlex.join(argv),
        "```",
        "",
        "Commands timed (SRC = the generated tree, OUT = a fresh path under --workdir):",
        "",
        "```",
        *(c.replace(src, "SRC") for c in commands),
        "```",
    ]
    return "\n".join(parts)


def _loadavg() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def _parse_size(text: str) -> int:
    units = {"KiB": 1024, "MiB": 1024**2, "GiB": GiB, "KB": 1000, "MB": 10**6, "GB": 10**9}
    for suffix, mult in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the pack benchmark and update RESULTS.md."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_peer"]:
        name, src, dst, shard_bytes = argv[1:5]
        _PEERS[name](src, dst, int(shard_bytes))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20000)
    parser.add_argument("--mean-kb", type=float, default=110.0)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--shard-size", default="1GiB", help="shard size of every writer")
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--regen", action="store_true", help="regenerate the source tree")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(argv)
    args.shard_size_bytes = _parse_size(args.shard_size)
    args.workdir = os.path.abspath(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)
    common.hold_bench_lock(args.workdir)

    configs = _configs(args.shard_size, args.shard_size_bytes)
    configs = common.select_named(parser, args.only, configs)

    src = _ensure_tree(args)
    num_files, payload = common.tree_payload(src)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    load_before = _loadavg()
    code_before = common.code_state(REPO)
    t0 = time.perf_counter()
    outcomes, cold = _measure(configs, src, args.workdir, args.repeat)
    print(f"measured in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    body = _report(
        outcomes,
        args=args,
        src=src,
        num_files=num_files,
        payload=payload,
        cold=cold,
        started=started,
        load_before=load_before,
        load_after=_loadavg(),
        code_before=code_before,
        code_after=common.code_state(REPO),
    )
    common.publish(body, SECTION, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
