"""A small, complete training script for train_8gpu.sbatch: staged data, ranks, checkpoints.

Every rank reads its share of the dataset the job staged (``$SHARDIO_STAGE_DIR``, verified
copies of ``$SHARDIO_DATA``), trains a tiny classifier on the mean byte of each image, and
saves a checkpoint (model, optimizer and the loader's position) every ``--ckpt-every`` steps
into ``$SHARDIO_CKPT_DIR``. A retry (``retry_srun.sh``) or a new job resumes from the newest
intact checkpoint, at the sample after the last one trained on. Run it by hand too::

    SHARDIO_DATA=out/ python examples/train.py --steps 20

Replace the model and the step with yours; the data and checkpoint parts stay as they are.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

from shardio import ShardDataset
from shardio.checkpoint import Checkpointer, load_latest
from shardio.errors import NoCheckpointError, ShardioError


def _features(batch: dict[str, object]) -> torch.Tensor:
    images = batch["jpeg"]
    means = [float(torch.frombuffer(bytearray(images[i]), dtype=torch.uint8).float().mean())
             for i in range(len(images))]  # type: ignore[arg-type]  # fmt: skip
    return torch.tensor(means).unsqueeze(1) / 255.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps in all")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--ckpt-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    if world > 1 and not dist.is_initialized():  # train_8gpu.sbatch sets MASTER_ADDR/PORT
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
        # A rendezvous that cannot complete (a rank that never came) is an error in minutes.
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5)
        )
    data = os.environ["SHARDIO_DATA"]
    stage = os.environ.get("SHARDIO_STAGE_DIR") or None
    ds = ShardDataset(data, stage=stage, seed=0, order=os.environ.get("SHARDIO_ORDER"))
    loader = ds.loader(batch_size=args.batch_size, num_workers=args.workers)
    classes = len(ds.classes or ()) or 1
    model = torch.nn.Linear(1, classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt_dir = os.environ.get("SHARDIO_CKPT_DIR", "ckpt")
    # retry_srun.sh names the checkpoint it checked: that one, else the newest intact one
    resume_from = os.environ.get("SHARDIO_RESUME_FROM") or ckpt_dir
    try:
        ck = load_latest(resume_from, loader=loader)  # and the loader's position
        model.load_state_dict(ck.state["model"])
        opt.load_state_dict(ck.state["opt"])
        step = ck.step + 1
        print(f"resumed from {ck.path} (step {ck.step})", flush=True)
    except NoCheckpointError:
        step = 0
        print("no checkpoint: a fresh start", flush=True)
    last_loss = float("nan")
    with Checkpointer(ckpt_dir, loader=loader, keep_full=2) as saver:
        while step < args.steps:
            for batch in loader:
                loss = torch.nn.functional.cross_entropy(model(_features(batch)), batch["cls"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                last_loss = loss.item()
                if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
                    state = {"model": model.state_dict(), "opt": opt.state_dict()}
                    saver.save(state, kind="full", step=step)
                step += 1
                if step >= args.steps:
                    break
            else:
                loader.set_epoch(ds.epoch + 1)  # the epoch ran out: the next one
    print(f"done: {step} steps, last loss {last_loss:.4f}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ShardioError as exc:  # a damaged dataset, a full disk: one line, not a traceback
        print(f"train_example: {exc}", file=sys.stderr)
        sys.exit(1)
