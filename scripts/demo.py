"""End-to-end demo: generate an ImageNet-like tree, pack it, verify it, read it back.

Run with ``make demo``. Everything lands in ``.demo/`` (git-ignored).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / ".demo"


def _load_generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_imagenet", ROOT / "scripts/gen_imagenet.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_imagenet"] = module
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> None:
    cmd = [sys.executable, "-m", "shardio", *args]
    print("$ shardio " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True)


def main() -> int:
    """Run the demo; return the exit code."""
    src, out = DEMO / "imagenet", DEMO / "packed"
    if not src.exists():
        gen = _load_generator()
        result = gen.generate(src, files=4000, classes=20, mean_kb=110)
        print(f"generated {result.files} JPEGs in {result.classes} classes at {src}")
    _run("pack", str(src), str(out), "--shard-size", "128MiB", "--force", "--no-progress")
    _run("verify", str(out), "--no-progress")
    _run("inspect", str(out))

    from shardio import ShardReader

    os.sync()  # the pack is on disk; the reads below come from the page cache
    start = time.perf_counter()
    nbytes = 0
    labels: set[int] = set()
    with ShardReader(out) as ds:
        for i in range(len(ds)):
            sample = ds.read_sample(i)
            nbytes += len(sample["jpeg"])
            labels.add(sample["cls"])
        n = len(ds)
    seconds = time.perf_counter() - start
    print(
        f"read back {n:,} samples ({nbytes / 1e6:,.1f} MB, {len(labels)} classes, every member "
        f"checksum-verified) in {seconds:.2f}s: {n / seconds:,.0f} samples/s, "
        f"{nbytes / seconds / 1e6:,.0f} MB/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
