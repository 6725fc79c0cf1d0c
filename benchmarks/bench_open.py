"""Start-up: a cold process that opens a ShardDataset and reads one sample, format 2 against
the previous release.

Format 2 binds index.bin to its manifest at open in O(1) (manifest xxh3-128, index size,
xxh3-64 of the header and extension table) and checks each shard's index records the first
time a reader touches that shard. The previous release (``OLD_COMMIT``, run from a git
worktree with the same venv) instead bounds-checked every record at open. Configurations:

- ``a``: today's code, dataset packed by today's code (format 2);
- ``b``: the previous release, dataset packed by it (format 1): the reference;
- ``c``: today's code on that format-1 dataset (legacy path: the whole index hashed at open);
- ``d``: as ``a``, plus ``Index.check_all()`` after open: what checking all at open would cost.

Each run is a fresh ``python -c`` child timed from before ``import shardio`` to after the
first sample; warm (the dataset's files read just before) and cold (``drop_caches`` before
the child); medians of ``--runs``, round-robin. Rewrites the "## Start-up" section of
benchmarks/RESULTS.md. Not a test: nothing asserts on timings.

Usage::

    sudo .venv/bin/python benchmarks/bench_open.py [--sizes 20000,1280000] [--runs 5]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Start-up: open a dataset and read one sample"
OLD_COMMIT = "500969a"
CLASSES = 1000
FILE_BYTES = 64
TARGET_SAMPLES, TARGET_SHARDS = 1_000_000_000, 100_000
PACK_SOURCES = ("shardio/format", "shardio/packing", "shardio/writers")
CONFIGS = {  # name: (label, code: "new"/"old", dataset: "new"/"old", check_all)
    "a": ("(a) today, format 2 (lazy per-shard checks)", "new", "new", False),
    "b": (f"(b) previous release {OLD_COMMIT}, format 1", "old", "old", False),
    "c": ("(c) today, format-1 dataset (whole index hashed)", "new", "old", False),
    "d": ("(d) today, format 2 + `Index.check_all()`", "new", "new", True),
}
CHILD = """\
import time

t0 = time.perf_counter()
import sys
import shardio

dataset_class = shardio.ShardDataset  # imports torch
t1 = time.perf_counter()
ds = dataset_class(sys.argv[1])
t2 = time.perf_counter()
if sys.argv[2] == "check_all":
    ds.packed.index.check_all()
t3 = time.perf_counter()
had_ma = "numpy.ma" in sys.modules
sample = ds[0]
t4 = time.perf_counter()
assert sample["__key__"]
import json

with open(sys.argv[3], "w") as fh:
    json.dump(
        {
            "import": t1 - t0,
            "open": t2 - t1,
            "check": t3 - t2,
            "first": t4 - t3,
            "total": t4 - t0,
            "module": shardio.__file__,
            "ma": not had_ma and "numpy.ma" in sys.modules,
        },
        fh,
    )
"""
PARTS = ("total", "import", "open", "check", "first", "startup", "wall")
HEADER = ["samples", "configuration", "cache", "index.bin MB", "total ms, median (min-max)"]
HEADER += ["import ms", "constructor ms", "check_all ms", "first sample ms"]
HEADER += ["constructor + check + first ms", "process wall ms", "total vs (b)"]
HEADER += ["constructor + check + first vs (b)"]


def _ensure_tree(workdir: str, n: int) -> str:
    """``n`` tiny files in ImageNet layout (train/<class>/<file>.JPEG), made once."""
    tree = os.path.join(workdir, f"open-tree-n{n}-c{CLASSES}-b{FILE_BYTES}")
    if os.path.exists(tree + ".done"):
        return tree
    print(f"generating {n:,} files in {tree}", file=sys.stderr, flush=True)
    common.remove_path(tree)
    for c in range(CLASSES):
        os.makedirs(os.path.join(tree, "train", f"n{c:08d}"))
    for i in range(n):
        c = i % CLASSES
        name = os.path.join(tree, "train", f"n{c:08d}", f"n{c:08d}_{i}.JPEG")
        with open(name, "wb") as fh:
            fh.write(f"{c:08d}/{i:010d}/".encode().ljust(FILE_BYTES, b"x"))
    with open(tree + ".done", "w") as fh:
        fh.write(f"{n} files\n")
    return tree


def _sources_digest() -> str:
    h = hashlib.sha256()
    for top in PACK_SOURCES:
        for root, dirs, names in os.walk(os.path.join(REPO, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in names if f.endswith(".py")):
                with open(os.path.join(root, name), "rb") as fh:
                    h.update(name.encode() + fh.read())
    return h.hexdigest()[:12]


def _ensure_packed(tree: str, out: str, shard_size: str, env: dict[str, str], cwd: str) -> str:
    if os.path.exists(os.path.join(out, "manifest.json")):
        return out
    for stale in glob.glob(out.rsplit("-", 1)[0] + "-*"):  # fmt2-<digest>: older sources
        common.remove_path(stale)
    argv = [sys.executable, "-m", "shardio", "pack", tree, out, "--shard-size", shard_size]
    argv += ["--workers", "2", "--no-progress"]
    print("packing:", shlex.join(argv), file=sys.stderr, flush=True)
    subprocess.run(argv, check=True, env=env, cwd=cwd, stdout=subprocess.DEVNULL)
    return out


def _warm(dataset: str) -> None:
    """Read the manifest and the index into the page cache (the shard is read by the run)."""
    for name in ("manifest.json", "index.bin"):
        with open(os.path.join(dataset, name), "rb") as fh:
            while fh.read(1 << 24):
                pass


def _run_once(
    name: str, dataset: str, env: dict[str, str], args: argparse.Namespace
) -> dict[str, Any]:
    result = os.path.join(args.workdir, "open-result.json")
    common.remove_path(result)
    check = "check_all" if CONFIGS[name][3] else "-"
    run = common.run_child(
        [sys.executable, "-c", CHILD, dataset, check, result], env=env, cwd=args.workdir
    )
    if run.returncode != 0:
        raise SystemExit(f"{name} failed on {dataset}:\n{run.stderr_tail}")
    with open(result) as fh:
        out: dict[str, Any] = json.load(fh)
    out["wall"] = run.wall_s
    out["startup"] = out["open"] + out["check"] + out["first"]
    return out


def _report(res: dict[tuple[int, str, str], list[dict[str, Any]]], info: dict[str, Any]) -> str:
    def med(key: tuple[int, str, str], part: str) -> float:
        return common.median([r[part] for r in res[key]])

    rows = []
    for (n, name, cache), runs in res.items():
        m = {p: med((n, name, cache), p) * 1e3 for p in PARTS}
        ref = {p: med((n, "b", cache), p) * 1e3 for p in PARTS}
        tot = sorted(r["total"] * 1e3 for r in runs)
        cells = [f"{m[p]:,.1f}" if p != "check" or CONFIGS[name][3] else "-" for p in PARTS[1:]]
        rows.append(
            [f"{n:,}", CONFIGS[name][0], cache, f"{info['index_mb'][(n, CONFIGS[name][2])]:.1f}"]
        )
        rows[-1] += [f"{m['total']:,.1f} ({tot[0]:,.0f}-{tot[-1]:,.0f})", *cells]
        rows[-1] += [common.fmt_ratio(m[p] / ref[p]) for p in ("total", "startup")]
    n_max = max(n for n, _, _ in res)
    check_s = med((n_max, "d", "warm"), "check")
    scaled = check_s * TARGET_SAMPLES / n_max
    per_shard = n_max / info["shards"][n_max]
    idx_bytes = info["index_mb"][(n_max, "new")] * 1e6 / n_max
    legacy = {c: med((n_max, c, "cold"), "open") * 1e3 for c in "abc"}
    lazy_ma = [f"({c})" for c in CONFIGS if any(r["ma"] for r in res[(n_max, c, "warm")])]
    ma_note = [
        "",
        f"`ds[0]` was what first imported `numpy.ma` in {', '.join(lazy_ma)}: numpy 2 loads "
        "it lazily (e.g. on the first `np.unique`), a few ms warm (`python -X importtime -c "
        "'import numpy.ma'`), part of the first-sample time there, once per process.",
    ]
    return "\n".join(
        [
            f"Run {info['started']}; shardio {common.package_version('shardio')}, numpy "
            f"{common.package_version('numpy')}, xxhash {common.package_version('xxhash')}, torch "
            f"{common.package_version('torch')}; previous release: `git worktree add --detach "
            f"TMP {OLD_COMMIT}`, run with `PYTHONPATH=TMP` and the same venv python.",
            "",
            info["code"],
            "",
            f"Data: {FILE_BYTES}-byte files in ImageNet layout (`train/<class>/<file>.JPEG`, "
            f"{CLASSES} classes), packed by each code with `[PYTHONPATH=TMP] python -m shardio "
            f"pack SRC OUT --shard-size {info['shard_size']} --workers 2 --no-progress` (tar; "
            + ", ".join(f"{n:,} samples in {s:,} shards" for n, s in info["shards"].items())
            + f": about {per_shard:,.0f} samples per shard, the ratio of "
            f"{TARGET_SAMPLES:,} samples in {TARGET_SHARDS:,} shards of real 110 KB images). "
            f"Each run is a fresh `python -c` child (cwd `.bench`, so only PYTHONPATH or the venv "
            f"supplies shardio); {info['runs']} runs per configuration, round-robin, each round "
            f"a cold run (`sync; echo 3 > /proc/sys/vm/drop_caches` just before the child: "
            f"{'done' if info['cold'] else '**NOT possible (not root): cold rows are warm**'}) "
            "then a warm run (manifest and index.bin read just before). One untimed run of each "
            f"configuration first. Load average before / after: {info['load'][0]} / "
            f"{info['load'][1]} (2 CPUs, other sessions may be running); measuring took "
            f"{info['elapsed']:.0f} s.",
            "",
            "Total = before `import shardio` to after `ds[0]`, inside the child: import "
            "(`shardio.ShardDataset` imports torch) + constructor `ShardDataset(path)` + (d only) "
            "`ds.packed.index.check_all()` + first sample `ds[0]` (in format 2 this checks the "
            "records of shard 0). Process wall = spawn to exit, as the parent sees it. Ratios "
            "are medians against (b) at the same size and cache, same run (lower is faster).",
            "",
            common.markdown_table(HEADER, rows),
            "",
            f"Why the checks are lazy: `Index.check_all()` took {check_s * 1e3:,.1f} ms (warm "
            f"median) for {n_max:,} samples in {info['shards'][n_max]:,} shards; linearly, "
            f"{TARGET_SAMPLES:,} samples in {TARGET_SHARDS:,} shards would take "
            f"**{scaled:,.0f} s** at every open, in every process (each DataLoader worker "
            f"opens the dataset). index.bin holds {idx_bytes:.0f} bytes per sample "
            f"({idx_bytes * TARGET_SAMPLES / 1e9:,.0f} GB at {TARGET_SAMPLES:,} samples); "
            f"the legacy format-1 path (c) hashes it whole at open: constructor {legacy['c']:,.1f} "
            f"ms cold at {n_max:,} samples, against {legacy['a']:,.1f} ms for (a) and "
            f"{legacy['b']:,.1f} ms for (b).",
            *(ma_note if lazy_ma else []),
            "",
            "Reproduce (root, for drop_caches):",
            "",
            "```",
            shlex.join(info["argv"]).replace(REPO + "/", ""),
            "```",
            "",
            "Each child, `python -c CHILD DATASET CHECK RESULT_JSON` (CHECK: `check_all` for "
            "(d), else `-`), CHILD being:",
            "",
            "```python",
            CHILD.rstrip(),
            "```",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20000,1280000", help="comma-separated sample counts")
    parser.add_argument("--runs", type=int, default=5, help="runs per configuration and cache")
    parser.add_argument("--shard-size", default="20MiB", help="about 10,000 tiny samples a shard")
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    args.workdir = os.path.abspath(args.workdir)
    common.hold_bench_lock(args.workdir)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    code_before = common.code_state(REPO)
    worktree = tempfile.mkdtemp(prefix=f"shardio-{OLD_COMMIT}-")
    git = ["git", "-C", REPO, "worktree"]
    subprocess.run([*git, "add", "--detach", worktree, OLD_COMMIT], check=True, capture_output=True)
    try:
        env_new = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env = {"new": env_new, "old": {**env_new, "PYTHONPATH": worktree}}
        roots = {"new": os.path.join(REPO, "shardio"), "old": os.path.join(worktree, "shardio")}
        keys = {"new": f"fmt2-{_sources_digest()}", "old": f"fmt1-{OLD_COMMIT}"}
        data: dict[tuple[int, str], str] = {}
        info: dict[str, Any] = {"index_mb": {}, "shards": {}, "shard_size": args.shard_size}
        for n in sizes:
            tree = _ensure_tree(args.workdir, n)
            for code, key in keys.items():
                out = os.path.join(args.workdir, f"open-n{n}-s{args.shard_size}-{key}")
                data[(n, code)] = _ensure_packed(
                    tree, out, args.shard_size, env[code], args.workdir
                )
                info["index_mb"][(n, code)] = os.path.getsize(os.path.join(out, "index.bin")) / 1e6
            with open(os.path.join(data[(n, "new")], "manifest.json")) as fh:
                info["shards"][n] = len(json.load(fh)["shards"])
        load_before = common.loadavg()
        t0 = datetime.datetime.now()
        for n in sizes:  # untimed: compile bytecode, check which shardio each child imports
            for name, (_, code, ds, _) in CONFIGS.items():
                module = _run_once(name, data[(n, ds)], env[code], args)["module"]
                if not module.startswith(roots[code] + os.sep):
                    raise SystemExit(f"{name} imported {module}, expected {roots[code]}")
        res: dict[tuple[int, str, str], list[dict[str, Any]]] = {
            (n, name, cache): [] for n in sizes for name in CONFIGS for cache in ("warm", "cold")
        }
        cold = True
        for rnd in range(args.runs):
            for n in sizes:
                for name, (_, code, ds, _) in CONFIGS.items():
                    cold = common.drop_caches() and cold
                    res[(n, name, "cold")].append(_run_once(name, data[(n, ds)], env[code], args))
                    _warm(data[(n, ds)])
                    res[(n, name, "warm")].append(_run_once(name, data[(n, ds)], env[code], args))
                    r = res[(n, name, "cold")][-1]
                    print(f"[{rnd + 1}] n={n} {name}: cold {r['total']:.3f} s", file=sys.stderr)
    finally:
        subprocess.run([*git, "remove", "--force", worktree], check=False, capture_output=True)
    info.update(
        started=started,
        runs=args.runs,
        cold=cold,
        load=(load_before, common.loadavg()),
        elapsed=(datetime.datetime.now() - t0).total_seconds(),
        code=common.code_line(code_before, common.code_state(REPO), "open"),
        argv=[sys.executable, *sys.argv],
    )
    body = _report(res, info)
    common.publish(body, SECTION, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
