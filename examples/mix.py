"""Train on a weighted mix of two packed datasets and print what the mix drew.

    python examples/mix.py web-ds/ books-ds/ --weights 0.7 0.3 --steps 20

A MixedDataset is one dataset to the model: each batch holds samples of both sources, each
source's share of every window of the epoch stays at its weight, and ``loader.metrics()``
counts what each source delivered. The model and the transform are examples/train.py's.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from train import small_image, tiny_cnn  # examples/ is on sys.path: the script's directory

from shardio import MixedDataset, ShardDataset
from shardio.errors import ShardioError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", nargs=2, help="two packed datasets (one label map)")
    parser.add_argument("--weights", type=float, nargs=2, default=[0.7, 0.3])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers")
    args = parser.parse_args()

    # Each source keeps its own seed, order, decoding (and staging or recovery=, if given).
    sources = [
        (ShardDataset(path, seed=s, decode="pil", transform=small_image), weight)
        for s, (path, weight) in enumerate(zip(args.data, args.weights, strict=True))
    ]
    names = [os.path.basename(os.path.normpath(p)) for p in args.data]
    if len(set(names)) < len(names):  # two datasets named alike: name them by position
        names = [str(s) for s in range(len(names))]
    # The labelled sources must share a label map (pack the second one with --labels-from),
    # or pass classes=[...] to remap both into the mix's own map by class name.
    mixed = MixedDataset(sources, seed=0, names=names)
    loader = mixed.loader(batch_size=args.batch_size, num_workers=args.workers)

    torch.manual_seed(0)
    model = tiny_cnn(len(mixed.classes or ()) or 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step, epoch, loss = 0, 0, torch.zeros(())
    seen = torch.zeros(len(names), dtype=torch.int64)
    while step < args.steps:
        loader.set_epoch(epoch)  # the mix's epoch and every source's
        for batch in loader:
            loss = torch.nn.functional.cross_entropy(model(batch["image"]), batch["cls"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            # __source__: which source each sample came from (an index into names)
            seen += torch.bincount(batch["__source__"], minlength=len(names))
            step += 1
            if step >= args.steps:
                break
        epoch += 1
    drawn = loader.metrics().sources  # samples delivered per source, by name
    share = {name: f"{n / max(1, sum(drawn.values())):.2f}" for name, n in drawn.items()}
    weights = {n: round(w, 3) for n, w in zip(names, mixed.weights, strict=True)}  # normalised
    print(f"mix of {len(mixed):,} samples an epoch, weights {weights}")
    print(f"{step} steps, last loss {loss.item():.4f}; the batches held {seen.tolist()}")
    print(f"drawn: {dict(drawn)} (shares {share})")
    loader.close()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ShardioError as exc:  # a damaged dataset, label maps that differ: one line
        print(f"mix: {exc}", file=sys.stderr)
        sys.exit(1)
