"""Train a tiny image classifier on a packed dataset: one process, torchrun or a SLURM job.

The same script runs three ways (see examples/README.md)::

    python examples/train.py --data out/ --steps 20                      # one GPU, or the CPU
    torchrun --nproc-per-node=2 examples/train.py --data out/ --steps 20  # DDP, 2 processes
    SHARDIO_DATA=... sbatch scripts/slurm/train_8gpu.sbatch               # examples/slurm.sh

Each rank reads its share of the dataset (decoded JPEGs resized to 32x32), trains the model
under DistributedDataParallel when there are several ranks, and saves a checkpoint (model,
optimizer and the loader's position) every ``--ckpt-every`` steps. A second run, a retry or
a new job resumes from the newest intact checkpoint, at the sample after the last one trained
on. Replace the model and the step with yours; the data and checkpoint parts stay as they are.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shardio import ShardDataset
from shardio.checkpoint import Checkpointer, load_latest
from shardio.errors import NoCheckpointError, ShardioError
from shardio.order import detect_ranks

SIZE = 32  # images are resized to SIZE x SIZE: every batch is one tensor, the model is tiny


def small_image(sample: dict[str, Any]) -> dict[str, Any]:
    """The transform: the decoded image (a PIL image) as a 3 x SIZE x SIZE float tensor.
    Module-level, so DataLoader workers started by spawn can unpickle it."""
    pixels = np.asarray(sample["jpeg"].convert("RGB").resize((SIZE, SIZE)), dtype=np.uint8)
    image = torch.from_numpy(pixels.copy()).permute(2, 0, 1).float().div(255)
    return {"__key__": sample["__key__"], "image": image, "cls": sample["cls"]}


def tiny_cnn(classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, classes),
    )


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device), from torchrun's or SLURM's variables; torch.distributed
    is initialised when there are several ranks (before the dataset: it reads the ranks)."""
    ranks = detect_ranks()  # strict: a malformed RANK or SLURM_PROCID is one clear error
    rank, world = ranks.rank, ranks.world_size
    device = torch.device("cpu")
    if torch.cuda.is_available():  # bind.sh leaves one GPU visible, torchrun all of them
        device = torch.device("cuda", ranks.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if world > 1:  # torchrun and train_8gpu.sbatch set MASTER_ADDR and MASTER_PORT
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            rank=rank,
            world_size=world,
            # a rendezvous that cannot complete (a rank that never came) fails in minutes
            timeout=datetime.timedelta(minutes=5),
        )
    return rank, world, device


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1 (argparse prints the error line)."""
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def main() -> int:
    env = os.environ
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=env.get("SHARDIO_DATA"), help="the packed dataset")
    stage = env.get("SHARDIO_STAGE_DIR") or None  # where train_8gpu.sbatch staged the data
    parser.add_argument("--stage", default=stage, help="its staging area (`shardio stage`)")
    parser.add_argument("--ckpt-dir", default=env.get("SHARDIO_CKPT_DIR", "ckpt"))
    parser.add_argument("--steps", type=positive, default=100, help="training steps in all")
    parser.add_argument("--batch-size", type=positive, default=32, help="per rank")
    parser.add_argument("--ckpt-every", type=positive, default=10, help="steps between checkpoints")
    parser.add_argument("--log-every", type=positive, default=5, help="steps between loss lines")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    parser.add_argument(
        "--policy",
        choices=("raise", "skip"),
        default=env.get("SHARDIO_POLICY") or None,
        help="what a sample that cannot be read intact does (default: raise; "
        "train_8gpu.sbatch passes SHARDIO_POLICY): skip substitutes another, journaled",
    )
    args = parser.parse_args()
    if not args.data:
        parser.error("give --data DIR (or set SHARDIO_DATA)")
    rank, world, device = init_distributed()
    who = f"rank {rank}/{world}: " if world > 1 else ""

    def log(line: str) -> None:  # one write a line: the ranks' lines never run into each other
        sys.stdout.write(f"{who}{line}\n")
        sys.stdout.flush()

    torch.manual_seed(0)  # every rank starts from the same weights (DDP also broadcasts them)

    # One order spec for the stage step and training (train_8gpu.sbatch passes SHARDIO_ORDER).
    order = env.get("SHARDIO_ORDER")
    ds = ShardDataset(
        args.data,
        stage=args.stage,
        seed=0,
        order=order,
        decode="pil",
        transform=small_image,
        recovery=args.policy,  # None: no recovery, a bad sample raises (as "raise" does)
    )
    cuda = device.type == "cuda"
    loader = ds.loader(batch_size=args.batch_size, num_workers=args.workers, pin_memory=cuda)
    model = tiny_cnn(len(ds.classes or ()) or 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    # Resume: model, optimizer and the loader's position come back together. retry_srun.sh
    # names the checkpoint it checked (SHARDIO_RESUME_FROM): that one, else the newest intact.
    try:
        ck = load_latest(env.get("SHARDIO_RESUME_FROM") or args.ckpt_dir, loader=loader)
        model.load_state_dict(ck.state["model"])
        opt.load_state_dict(ck.state["opt"])
        step = ck.step + 1
        log(f"resumed from {ck.path} (step {ck.step})")
    except NoCheckpointError:  # only when there is none: a damaged one is an error
        step = 0
        log("no checkpoint: a fresh start")
    # Wrapped after loading, so the checkpoint holds the plain model's keys (no "module.").
    net = DistributedDataParallel(model) if world > 1 else model

    loss = torch.zeros(())
    # Every rank calls save at the same steps; rank 0 commits the checkpoint.
    with Checkpointer(args.ckpt_dir, loader=loader, keep_full=2) as saver:
        while step < args.steps:
            for batch in loader:  # every rank gets as many batches: DDP never waits at the end
                images = batch["image"].to(device, non_blocking=True)
                labels = batch["cls"].to(device, non_blocking=True)
                loss = torch.nn.functional.cross_entropy(net(images), labels)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if (step + 1) % args.log_every == 0:
                    log(f"step {step + 1}: loss {loss.item():.4f}")
                if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
                    state = {"model": model.state_dict(), "opt": opt.state_dict()}
                    saver.save(state, kind="full", step=step)
                step += 1
                if step >= args.steps:
                    break
            else:
                loader.set_epoch(ds.epoch + 1)  # the epoch ran out: the next one, reshuffled
    log(f"done: {step} steps, last loss {loss.item():.4f}")
    log(f"loader: {loader.metrics().line()}")
    loader.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ShardioError as exc:  # a damaged dataset, a full disk: one line, not a traceback
        print(f"train: {exc}", file=sys.stderr)
        sys.exit(1)
