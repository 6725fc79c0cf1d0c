"""End-to-end demo: generate an ImageNet-like tree, pack it, verify it, read it back, and
train a tiny model on it through ``ds.loader(...)`` (a torch DataLoader underneath).

Run with ``make demo``. Everything lands in ``.demo/`` (git-ignored); ``--dir``, ``--files``
and ``--steps`` make it smaller (the tests run it that way).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


def small_image(sample: dict[str, Any]) -> dict[str, Any]:
    """The training sample: the decoded JPEG as a 3x32x32 float tensor, and its label (a
    module-level function: DataLoader workers get it by pickling)."""
    import numpy as np
    import torch

    pixels = np.asarray(sample["jpeg"].resize((32, 32)), dtype=np.uint8)
    image = torch.from_numpy(pixels.copy()).permute(2, 0, 1).float().div(255)
    return {"__key__": sample["__key__"], "image": image, "cls": sample["cls"]}


def train(out: Path, *, classes: int, steps: int) -> None:
    """A few steps of a tiny classifier over the packed dataset, then the loader's figures."""
    import torch

    from shardio import ShardDataset

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, classes))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ds = ShardDataset(out, decode="pil", transform=small_image, seed=0)
    loader = ds.loader(batch_size=64, num_workers=2)
    losses: list[float] = []
    try:
        for _, batch in zip(range(steps), loader, strict=False):  # no batch fetched past
            loss = torch.nn.functional.cross_entropy(model(batch["image"]), batch["cls"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        figures = loader.metrics()
        state = loader.state_dict()
    finally:
        loader.close()
    print(
        f"trained {len(losses)} steps of 64 (loss {losses[0]:.2f} -> {losses[-1]:.2f}: the "
        f"generated images are noise, so it stays near ln({classes}) = {math.log(classes):.2f}); "
        f"loader.state_dict() would resume after {state['consumed']} samples"
    )
    print(f"loader: {figures.line()}")


def main(argv: list[str] | None = None) -> int:
    """Run the demo; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, default=DEMO, help="where everything lands")
    parser.add_argument("--files", type=int, default=4000, help="JPEGs to generate")
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    args = parser.parse_args(argv)
    classes = 20
    src, out = args.dir / "imagenet", args.dir / "packed"
    if not src.exists():
        gen = _load_generator()
        result = gen.generate(src, files=args.files, classes=classes, mean_kb=110)
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
    train(out, classes=classes, steps=args.steps)
    print(
        "next: the guides of the docs site (docs/index.md; `make docs-serve` serves it): "
        "docs/guides/training.md for the loader, staging-slurm.md for a cluster job, "
        "healing.md and checkpoints.md; examples/ for complete scripts; `make test` for the "
        "test suite"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
