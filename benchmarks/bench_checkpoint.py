#!/usr/bin/env python3
"""Checkpoints: the training's stall per save and the write throughput, against ``torch.save``
and ``torch.distributed.checkpoint`` (its ``save`` and ``async_save``), and compressed sizes.

Each save runs in a child process of its own (one rank, no process group) holding a state of
``--sizes`` GB: fp32 tensors (three quarters: weights and optimizer moments from a normal
distribution, as trained values are) and bf16 ones (a quarter), in 64 MiB tensors, and a
loader-like state. Per method:

- **stall**: how long the training thread is blocked: all of it for ``torch.save``,
  ``dcp.save`` and shardio's ``save``; until ``dcp.async_save`` returns (its staging copy);
  until ``Checkpointer.save`` returns (shardio's copy to host memory; "2nd save": the save
  after a first one, whose buffers it copies into, as every save of a training run but the
  first; "verify=False": without reading the checkpoint back before pruning);
- **durable**: until the checkpoint is complete and fsynced (``torch.save`` is followed by an
  fsync here, as every other method fsyncs), the page cache dropped before each run;
- bytes on disk and the child's peak RSS.

On local disk and on the MooseFS bed (``scripts/pfs/moosefs.sh up``, 2 chunkservers, one
copy). Then the compressed size against raw for fp32, bf16 and a loader state at Zstandard
levels 1 and 3 (how the level was chosen). Anchors: PyTorch's async checkpointing cut a 7B
model's blocking time from 149 s to 6 s; CheckFreq keeps checkpoint overhead at or below 3.5%
of training time (here: the stall over the 600 s between light checkpoints).

``python benchmarks/bench_checkpoint.py [--sizes 1,10] [--repeat 3] [--places local,bed]``;
writes the section "## Checkpoints" of benchmarks/RESULTS.md (``--no-write``: print only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Checkpoints"
BED_SCRIPT = os.path.join(REPO, "scripts", "pfs", "moosefs.sh")
METHODS = (
    "torch.save",
    "dcp.save",
    "dcp.async_save",
    "shardio save",
    "shardio Checkpointer",
    "shardio Checkpointer, 2nd save",
    "shardio Checkpointer, verify=False",
)

_CHILD = r"""
import json, os, resource, sys, time
import torch
args = json.loads(sys.argv[1])
gb, method, where = args["gb"], args["method"], args["dir"]
chunk = 16 << 20  # elements: 64 MiB of fp32
state, left, i = {"model": {}, "loader": {"epoch": 3, "consumed": 123456,
                  "history": [[8, 1, 1000 * k] for k in range(200)]}}, int(gb * 1e9), 0
while left > 0:
    t = torch.randn(min(chunk, left // 4))
    if i % 4 == 3:
        t = t.to(torch.bfloat16)
    state["model"][f"t{i}"] = t
    left -= t.numel() * t.element_size()
    i += 1
raw = sum(t.numel() * t.element_size() for t in state["model"].values())
print("ready", flush=True)
sys.stdin.readline()  # the parent dropped the caches
began = time.perf_counter()
if method == "torch.save":
    path = os.path.join(where, "state.pt")
    with open(path, "wb") as fh:
        torch.save(state, fh)
        fh.flush(); os.fsync(fh.fileno())
    stall = durable = time.perf_counter() - began
elif method.startswith("dcp"):
    import torch.distributed.checkpoint as dcp
    if method == "dcp.save":
        dcp.save(state, checkpoint_id=os.path.join(where, "dcp"))
        stall = time.perf_counter() - began
    else:
        future = dcp.async_save(state, checkpoint_id=os.path.join(where, "dcp"))
        stall = time.perf_counter() - began
        future.result()
    durable = time.perf_counter() - began
else:
    from shardio.checkpoint import Checkpointer, save
    env = {"SLURM_JOB_ID": "1"}
    extra = {"verify": False} if method.endswith("verify=False") else {}
    if method == "shardio save":
        save(state, where, step=1, environ=env)
        stall = time.perf_counter() - began
    else:
        saver = Checkpointer(where, environ=env, keep_full=1, **extra)
        if method.endswith("2nd save"):  # the first fills the buffers, as in training
            saver.save(state, step=1)
            saver.wait()
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("3\n")
            began = time.perf_counter()
        saver.save(state, step=2)
        stall = time.perf_counter() - began
        saver.wait(); saver.close()
    durable = time.perf_counter() - began
size = 0
for root, _, files in os.walk(where):
    size += sum(os.path.getsize(os.path.join(root, f)) for f in files)
print(json.dumps({"stall": stall, "durable": durable, "raw": raw, "bytes": size,
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), flush=True)
"""

_SIZES = r"""
import json, time, torch, zstandard
out = {}
gen = torch.Generator().manual_seed(0)
w = torch.randn(32 << 20, generator=gen)  # 128 MiB of fp32
data = {"fp32 weights": w.numpy().tobytes(),
        "bf16 weights": w.to(torch.bfloat16).view(torch.int16).numpy().tobytes()}
import io
buf = io.BytesIO()
torch.save({"epoch": 3, "consumed": 123456, "spec": {"order": "random", "seed": 1,
            "partition": "node"}, "history": [[8, 1, 1000 * k] for k in range(2000)]}, buf)
data["loader state (torch.save)"] = buf.getvalue()
for name, raw in data.items():
    for level in (1, 3):
        for threads in (0, 2):
            c = zstandard.ZstdCompressor(level=level, threads=threads)
            began = time.perf_counter()
            packed = c.compress(raw)
            took = time.perf_counter() - began
            out[f"{name}|{level}|{threads}"] = [len(raw), len(packed), took]
print(json.dumps(out))
"""


def _child(method: str, gb: float, where: str) -> dict[str, Any]:
    common.remove_path(where)
    os.makedirs(where)
    spec = json.dumps({"method": method, "gb": gb, "dir": where})
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, cwd=REPO,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit(f"{method}: the child did not start")
    common.drop_caches()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    proc.communicate(timeout=600)
    if proc.returncode != 0 or not line:
        raise SystemExit(f"{method} at {gb} GB failed (exit {proc.returncode})")
    result: dict[str, Any] = json.loads(line)
    common.remove_path(where)
    return result


class _Bed:
    def __init__(self, root: str) -> None:
        self.root, self.mount = root, os.path.join(root, "mnt")

    def __enter__(self) -> _Bed:
        argv = ["bash", BED_SCRIPT, "up", self.root, "--chunkservers", "2", "--goal", "1"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"moosefs.sh up failed: {proc.stderr.strip()[-500:]}")
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["bash", BED_SCRIPT, "down", self.root], capture_output=True,
                       timeout=300, check=False)  # fmt: skip


def _measure(place: str, base: str, sizes: list[float], repeat: int) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for gb in sizes:
        runs = repeat if gb <= 2 else 1
        for method in METHODS:
            got = [_child(method, gb, os.path.join(base, "ckpt")) for _ in range(runs)]
            stall = common.median([g["stall"] for g in got])
            durable = common.median([g["durable"] for g in got])
            figures[f"{place}|{gb}|{method}"] = {
                "stall": stall, "durable": durable, "raw": got[0]["raw"],
                "bytes": got[0]["bytes"], "rss": max(g["rss"] for g in got), "runs": runs,
                "all_stalls": [g["stall"] for g in got],
            }  # fmt: skip
            print(f"{place} {gb} GB {method}: stall {stall:.2f} s, durable {durable:.2f} s",
                  file=sys.stderr)  # fmt: skip
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,10", help="GB of state, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="runs per method up to 2 GB")
    parser.add_argument("--places", default="local,bed")
    parser.add_argument("--bed-sizes", default="1", help="GB of state on the bed")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "bench-ckpt"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    before = common.code_state(REPO)
    os.makedirs(args.workdir, exist_ok=True)
    figures: dict[str, Any] = {}
    places = args.places.split(",")
    if "local" in places:
        figures.update(_measure("local disk", args.workdir, sizes, args.repeat))
    if "bed" in places:
        with _Bed(os.path.join(args.workdir, "bed")) as bed:
            bed_sizes = [float(s) for s in args.bed_sizes.split(",")]
            figures.update(_measure("MooseFS bed", bed.mount, bed_sizes, args.repeat))
    sizes_run = json.loads(subprocess.run([sys.executable, "-c", _SIZES], capture_output=True,
                                          text=True, check=True, cwd=REPO).stdout)  # fmt: skip
    shutil.rmtree(os.path.join(args.workdir, "ckpt"), ignore_errors=True)
    after = common.code_state(REPO)
    body = _report(figures, sizes_run, args, before, after)
    print(body)
    if not args.no_write:
        common.update_section(args.out, SECTION, body, common.results_header(args.workdir))
    return 0


def _report(figures: dict[str, Any], sizes_run: dict[str, Any], args: Any, before: Any,
            after: Any) -> str:  # fmt: skip
    rows = []
    for key, f in figures.items():
        place, gb, method = key.split("|")
        base = figures[f"{place}|{gb}|torch.save"]
        rows.append([
            place, f"{float(gb):g}", method, f"{f['stall']:.2f}", f"{f['durable']:.2f}",
            f"{f['raw'] / f['durable'] / 1e9:.2f}", f"{f['stall'] / base['stall']:.3f}",
            f"{f['bytes'] / 1e9:.2f}", f"{f['stall'] / 600:.2%}", f"{f['rss'] / 1e9:.1f}",
        ])  # fmt: skip
    table = common.markdown_table(
        ["where", "GB", "method", "stall s", "durable s", "GB/s", "stall vs torch.save",
         "GB on disk", "stall / 600 s", "peak RSS GB"], rows,
    )  # fmt: skip
    size_rows = []
    for key, (raw, packed, took) in sizes_run.items():
        name, level, threads = key.split("|")
        size_rows.append([name, level, threads, f"{raw / packed:.3f}x",
                          f"{raw / took / 1e6:,.0f}"])  # fmt: skip
    sizes_table = common.markdown_table(
        ["data", "zstd level", "threads", "raw / compressed", "MB/s"], size_rows
    )
    summary = []
    for key, f in figures.items():
        place, gb, method = key.split("|")
        if method != "shardio Checkpointer, 2nd save":
            continue
        plain = figures[f"{place}|{gb}|torch.save"]
        dcp_async = figures[f"{place}|{gb}|dcp.async_save"]
        summary.append(
            f"{place}, {float(gb):g} GB: the training waits {f['stall']:.2f} s per checkpoint "
            f"(torch.save {plain['stall']:.2f} s: {f['stall'] / plain['stall']:.3f}x; "
            f"dcp.async_save {dcp_async['stall']:.2f} s: "
            f"{f['stall'] / dcp_async['stall']:.3f}x)"
        )
    repeats = {k: f["all_stalls"] for k, f in figures.items() if f["runs"] > 1}
    spread = "; ".join(f"{k.split('|')[2]} ({k.split('|')[0]}) "
                       f"{', '.join(f'{v:.2f}' for v in vals)}"
                       for k, vals in list(repeats.items())[:6])  # fmt: skip
    return "\n\n".join(
        [
            common.code_line(before, after, "benchmarks/bench_checkpoint.py"),
            f"`python benchmarks/bench_checkpoint.py {' '.join(sys.argv[1:])}`. One rank, one "
            "child process per save holding the state (three quarters fp32, a quarter bf16, "
            "64 MiB tensors, randn values), page "
            f"cache dropped before each save; medians of {args.repeat} runs up to 2 GB, one run "
            "above. *Stall*: the training thread blocked; *durable*: complete and fsynced "
            "(torch.save followed by an fsync). *stall / 600 s*: the stall as a share of the "
            "10 minutes between light checkpoints (CheckFreq's bound: 3.5%).",
            table,
            f"Stalls of the repeated runs (s): {spread}.",
            "**Reading.** " + "; ".join(summary) + ". The first save of a process pays for "
            "new host memory (on this VM a first touch of every page costs as much as the copy); "
            "every later one copies into the buffers of the one before. *durable* of the "
            "Checkpointer includes reading the checkpoint back from the storage (page cache "
            "dropped) before older ones are pruned (`verify=False` skips it); a `save()` without "
            "`keep` prunes nothing and reads nothing back. **Engine**: shardio writes one "
            "`torch.save` stream per rank rather than through `torch.distributed.checkpoint`: "
            "DCP's synchronous save is no faster here, its async save blocks the step for its "
            "staging copy each time, and it has no checksum, no atomic commit (a killed save "
            "leaves a partial directory under its final name) and no fallback; what it adds, "
            "loading a sharded state on another number of ranks, shardio leaves to it.",
            "**Compression by data and level** (the choice of level 1 and of compressing the "
            "whole stream): 128 MiB of fp32 and its bf16 copy, a loader state:",
            sizes_table,
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
