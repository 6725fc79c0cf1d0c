"""What the provenance checks cost on the read path: this tree against an earlier commit.

The dataset id (the xxh3-128 of the manifest bytes the open already reads), the check of a
``cache=`` staging area against it, and the per-read eviction and identity checks are on the
read path. This A/B runs the same children with ``PYTHONPATH`` set to a ``git worktree`` of
``--base`` (default: the commit before those checks) and to this tree, alternating round by
round, warm page cache, each configuration a fresh child that reports which ``shardio`` it
imported. It measures ``ShardDataset(ds[, cache=AREA])`` plus ``ds[0]``, and one map-mode epoch
through ``ds.loader(batch_size=64, num_workers=2)`` from the source and from a staged area.
Medians and ratios only; nothing is asserted.

The section "## Provenance checks on the read path" of benchmarks/RESULTS.md gets the figures.

Usage::

    .venv/bin/python benchmarks/bench_hardening.py [--files 3000] [--rounds 9] [--base REV]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Provenance checks on the read path"
BASE = "f444c8a"  # the last commit before the dataset id and the cache= identity check

CHILD = """
import json, sys, time
import shardio
dataset_class = shardio.ShardDataset  # imports torch, before the clock
path, cache, what = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
ds = dataset_class(path, cache=None if cache == "-" else cache)
first = ds[0]
t1 = time.perf_counter()
n = 0
if what == "epoch":
    for batch in ds.loader(batch_size=64, num_workers=2):
        n += len(batch["__key__"])
t2 = time.perf_counter()
print(json.dumps({"open_ms": (t1 - t0) * 1e3, "epoch_s": t2 - t1, "n": n,
                  "module": shardio.__file__}))
"""

CONFIGS = [
    ("open", "`ShardDataset(ds)` + `ds[0]`", "-", "open", "open_ms", "ms"),
    ("open-cache", "`ShardDataset(ds, cache=area)` + `ds[0]`", "area", "open", "open_ms", "ms"),
    ("epoch", "map epoch, `loader(batch_size=64, num_workers=2)`", "-", "epoch", "epoch_s", "s"),
    ("epoch-cache", "map epoch from the staged area", "area", "epoch", "epoch_s", "s"),
]


def _run(root: str, data: str, cache: str, what: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "ds", cache, what],
        env=env, cwd=data, capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"child failed ({root}, {what}): {done.stderr.strip()[-400:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not os.path.abspath(result["module"]).startswith(os.path.abspath(root) + os.sep):
        raise SystemExit(f"the child imported {result['module']}, not the code under {root}")
    return result


def _prepare(workdir: str, files: int) -> str:
    data = os.path.join(workdir, f"hardening-f{files}")
    if not os.path.exists(os.path.join(data, "ds", "manifest.json")):
        common.remove_path(data)
        os.makedirs(data)
        gen = os.path.join(REPO, "scripts", "gen_imagenet.py")
        subprocess.run(
            [sys.executable, gen, os.path.join(data, "tree"), "--files", str(files),
             "--classes", "20", "--quiet"], check=True,
        )  # fmt: skip
        shardio_bin = [sys.executable, "-m", "shardio"]
        subprocess.run(
            [*shardio_bin, "pack", "tree", "ds", "--shard-size", "64MiB", "--no-progress"],
            cwd=data, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        subprocess.run(
            [*shardio_bin, "stage", "ds", "area", "--node", "0/1", "--no-progress"],
            cwd=data, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    common.warm_up(os.path.join(data, "ds"), os.path.join(data, "area"))
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--base", default=BASE, help="the commit to compare against")
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    before = common.code_state(REPO)
    data = _prepare(args.workdir, args.files)
    base_tree = tempfile.mkdtemp(prefix="shardio-base-")
    os.rmdir(base_tree)
    subprocess.run(
        ["git", "-C", REPO, "worktree", "add", "--detach", base_tree, args.base],
        check=True, capture_output=True,
    )  # fmt: skip
    load_before = common.loadavg()
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(args.rounds):
            for code, root in (("before", base_tree), ("now", REPO)):
                for name, _label, cache, what, key, _unit in CONFIGS:
                    result = _run(root, data, cache, what)
                    times.setdefault((name, code), []).append(result[key])
    finally:
        subprocess.run(
            ["git", "-C", REPO, "worktree", "remove", "--force", base_tree],
            check=False, capture_output=True,
        )  # fmt: skip
        shutil.rmtree(base_tree, ignore_errors=True)
    rows = []
    for name, label, _cache, _what, _key, unit in CONFIGS:
        old, new = times[(name, "before")], times[(name, "now")]
        digits = 2 if unit == "ms" else 3
        cell = [
            f"{statistics.median(v):.{digits}f} {unit} ({min(v):.{digits}f}-{max(v):.{digits}f})"
            for v in (old, new)
        ]
        ratio = statistics.median(new) / statistics.median(old)
        spread = "" if min(old) <= statistics.median(new) <= max(old) else " (outside)"
        rows.append([label, *cell, common.fmt_ratio(ratio) + spread])
    header = ["", "before, median (min-max)", "now, median (min-max)", "now / before"]
    table = common.markdown_table(header, rows)
    body = "\n".join(
        [
            f"Run {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; "
            f"before = `git worktree add --detach TMP {args.base}` run with `PYTHONPATH=TMP`, "
            "now = this tree, the same venv python; each child checks which shardio it imported.",
            "",
            common.code_line(before, common.code_state(REPO), "read"),
            "",
            f"Data: `scripts/gen_imagenet.py --files {args.files} --classes 20` packed with "
            "`shardio pack --shard-size 64MiB` and staged with `shardio stage ds area --node 0/1`."
            f" Warm page cache; {args.rounds} rounds, before and now alternating, every "
            "configuration a fresh child. Load average before / after: "
            f"{load_before} / {common.loadavg()}.",
            "",
            table,
            "",
            "A ratio marked (outside) has its median outside the min-max of the runs before; "
            "the others are within run-to-run noise on this machine.",
            "",
            "Reproduce: `.venv/bin/python benchmarks/bench_hardening.py`.",
        ]
    )
    print(table)
    if not args.no_write:
        common.update_section(args.out, SECTION, body, common.results_header(args.workdir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
