#!/usr/bin/env python3
"""GPU data path: GPUPrefetcher against a plain copy per step, and DALI's mixed decoding
through shardio's verified reader against DALI's own reader.

On one generated ImageNet-like tree packed into tar shards, each configuration runs
``--repeat`` epochs (page cache warm) and reports the median epoch time, samples/s and, for
the prefetcher, the stall fraction it measured:

1. ``loader + .to(device)``: ``ds.loader(B, W)``, each batch's payload and labels copied to
   the GPU in the training thread, then the simulated step (``--step-ms`` of GPU work,
   ``torch.cuda._sleep``);
2. ``GPUPrefetcher(depth=2)``: the same loader wrapped, the copy of the next batch on a side
   stream while the step runs;
3. ``shardio.dali.loader(decode="mixed", crop=224)``: shardio reads and verifies, nvJPEG
   decodes on the GPU;
4. the same with ``verify=False``: DALI's ``fn.readers.webdataset`` reads the shards itself
   (unchecked), nvJPEG decodes.

Needs a CUDA device (exit code 2 without one). ``--device cpu`` runs rows 1 and 2 on the CPU
as a smoke test of the script (figures not written). ``scripts/gpu_check.sh`` runs this
after ``pytest -m gpu``. Not a test: it measures and writes the section
"## GPU prefetch and DALI mixed decoding" of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## GPU prefetch and DALI mixed decoding"
CROP = 224


def _step(device: Any, step_s: float, cycles_per_s: float) -> None:
    """The simulated training step: ``step_s`` of GPU work (host sleep on the CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda._sleep(int(step_s * cycles_per_s))
    else:
        time.sleep(step_s)


def _cycles_per_s(device: Any) -> float:
    """GPU cycles of ``torch.cuda._sleep`` per second, measured once."""
    import torch

    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    began = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize(device)
    return 100_000_000 / (time.perf_counter() - began)


def _to_device(batch: dict[str, Any], device: Any) -> int:
    """Copy a batch's payload and labels to ``device`` (the plain way); return its bytes."""
    payload = batch["jpeg"].buffer
    payload.to(device)
    batch["cls"].to(device)
    return int(payload.numel())


def _epoch_plain(pack: str, args: argparse.Namespace, device: Any, cps: float) -> dict[str, Any]:
    import torch

    from shardio import ShardDataset

    loader = ShardDataset(pack, seed=0).loader(args.batch_size, args.workers)
    began = time.perf_counter()
    samples = 0
    for batch in loader:
        _to_device(batch, device)
        _step(device, args.step_ms / 1000, cps)
        samples += len(batch["__key__"])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"seconds": time.perf_counter() - began, "samples": samples, "stall": None}


def _epoch_prefetch(pack: str, args: argparse.Namespace, device: Any, cps: float) -> dict[str, Any]:
    import torch

    from shardio import GPUPrefetcher, ShardDataset

    loader = ShardDataset(pack, seed=0).loader(args.batch_size, args.workers)
    began = time.perf_counter()
    samples = 0
    with GPUPrefetcher(loader, device=device, depth=2) as pf:
        for batch in pf:
            _step(device, args.step_ms / 1000, cps)
            samples += len(batch["__key__"])
        stall = pf.metrics().stall_fraction
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"seconds": time.perf_counter() - began, "samples": samples, "stall": stall}


def _epoch_dali(verify: bool) -> Callable[..., dict[str, Any]]:
    def run(pack: str, args: argparse.Namespace, device: Any, cps: float) -> dict[str, Any]:
        import torch

        import shardio.dali as sdali

        loader = sdali.loader(
            pack,
            batch_size=args.batch_size,
            num_threads=args.workers,
            device_id=device.index or 0,
            decode="mixed",
            crop=CROP,
            verify=verify,
        )
        began = time.perf_counter()
        samples = 0
        for batch in loader:
            _step(device, args.step_ms / 1000, cps)
            samples += int(batch["label"].shape[0])
        torch.cuda.synchronize(device)
        return {"seconds": time.perf_counter() - began, "samples": samples, "stall": None}

    return run


ROWS: list[tuple[str, Callable[..., dict[str, Any]], bool]] = [
    ("loader + .to(device) each step", _epoch_plain, False),
    ("GPUPrefetcher(depth=2)", _epoch_prefetch, False),
    ("shardio.dali verified, decode='mixed'", _epoch_dali(True), True),
    ("DALI's own reader (verify=False), decode='mixed'", _epoch_dali(False), True),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4000)
    parser.add_argument("--mean-kb", type=float, default=110.0)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated GPU step")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA device (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    os.makedirs(args.workdir, exist_ok=True)
    src = common.ensure_tree(
        REPO, args.workdir, files=args.files, classes=args.classes, mean_kb=args.mean_kb
    )
    pack = os.path.join(args.workdir, f"gpu-f{args.files}-kb{args.mean_kb:g}-tar")
    if not os.path.exists(pack + ".done"):
        from shardio.packing.run import PackOptions
        from shardio.packing.run import pack as pack_tree

        common.remove_path(pack)
        pack_tree(src, pack, PackOptions(shard_format="tar", shard_size_bytes=64 << 20))
        with open(pack + ".done", "w") as fh:
            fh.write("packed\n")
    cps = _cycles_per_s(device)
    rows = []
    for name, run, needs_gpu in ROWS:
        if needs_gpu and device.type != "cuda":
            rows.append([name, "not run (CPU smoke run)", "", ""])
            continue
        run(pack, args, device, cps)  # warm: page cache, DALI's and CUDA's start-up
        results = [run(pack, args, device, cps) for _ in range(args.repeat)]
        seconds = statistics.median(r["seconds"] for r in results)
        samples = results[0]["samples"]
        stalls = [r["stall"] for r in results if r["stall"] is not None]
        stall = f"{statistics.median(stalls):.1%}" if stalls else "—"
        rows.append([name, f"{seconds:.2f}", f"{samples / seconds:,.0f}", stall])
        print(f"{name}: {seconds:.2f} s, {samples / seconds:,.0f} samples/s", file=sys.stderr)
    base = float(rows[0][1]) if rows[0][1][0].isdigit() else None
    for row in rows:
        ratio = base / float(row[1]) if base and row[1][:1].isdigit() else None
        row.append(f"{ratio:.2f}x" if ratio else "")
    table = common.markdown_table(
        ["configuration", "epoch s (median)", "samples/s", "stall", "vs plain copy"], rows
    )
    body = (
        f"{args.files:,} JPEGs of ~{args.mean_kb:g} KB packed into 64 MiB tar shards; batch "
        f"{args.batch_size}, {args.workers} workers (DALI: threads), a simulated step of "
        f"{args.step_ms:g} ms of GPU work per batch, page cache warm, median of "
        f"{args.repeat} epochs after one warm-up, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + ". `python benchmarks/bench_gpu.py` (run by `scripts/gpu_check.sh`).\n\n"
        + table
    )
    print(table)
    if not args.no_write and device.type == "cuda":
        common.update_section(args.out, SECTION, body, common.results_header(args.workdir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
