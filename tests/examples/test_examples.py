"""examples/: train.py as one process and under torchrun (2 ranks, gloo), and mix.py.

The data is a tiny ImageNet-like tree of real JPEGs (scripts/gen_imagenet.py: 96 files of ~2 KB
in 4 classes, 56 in train/ and 40 in val/), packed into 64 KiB shards: whole, and as two
datasets (train/, and val/ with train's label map) for the mix. examples/slurm.sh runs on the
real SLURM cluster in tests/slurm/test_examples_slurm.py.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

pytest.importorskip("torch")
pytest.importorskip("PIL")

# Variables of the caller's shell that would make the script a rank of some other job.
_SCRUBBED_PREFIXES = ("SLURM_", "SHARDIO_", "TORCHELASTIC_")
_SCRUBBED = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}


def run(argv: list[str], cwd: pathlib.Path, timeout: float = 120) -> str:
    """Run ``argv`` in ``cwd`` with a deprecated shardio name an error; its stdout."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_SCRUBBED_PREFIXES) and k not in _SCRUBBED
    }
    env["PYTHONWARNINGS"] = "error::DeprecationWarning:shardio"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A directory holding ``out/`` (the whole tree packed), ``train-ds/`` and ``val-ds/``."""
    root = tmp_path_factory.mktemp("examples")
    gen = [sys.executable, str(REPO / "scripts" / "gen_imagenet.py"), "imagenet"]
    run([*gen, "--files", "96", "--classes", "4", "--mean-kb", "2", "--val-fraction", "0.4",
         "--quiet"], root)  # fmt: skip
    shardio = [sys.executable, "-m", "shardio", "pack", "--shard-size", "64KiB", "--no-progress"]
    run([*shardio, "imagenet/", "out/"], root)
    run([*shardio, "imagenet/train/", "train-ds/"], root)
    run([*shardio, "imagenet/val/", "val-ds/", "--labels-from", "train-ds/"], root)
    return root


def train(cwd: pathlib.Path, *args: str) -> str:
    # 96 samples in batches of 8: 12 steps an epoch on one rank, 6 on each of two
    common = ["--data", "out/", "--batch-size", "8", "--ckpt-every", "3", "--log-every", "3"]
    return run([sys.executable, str(EXAMPLES / "train.py"), *common, *args], cwd)


def last_loss(out: str, steps: int, who: str = "") -> str:
    match = re.search(rf"^{who}done: {steps} steps, last loss (\d+\.\d{{4}})$", out, re.M)
    assert match, out
    return match.group(1)


def test_train_one_process_trains_and_resumes_exactly(data: pathlib.Path) -> None:
    first = train(data, "--steps", "6", "--ckpt-dir", "ckpt-a")
    assert first.splitlines()[0] == "no checkpoint: a fresh start"
    assert re.search(r"^step 3: loss \d+\.\d{4}\nstep 6: loss \d+\.\d{4}$", first, re.M), first
    last_loss(first, 6)
    assert re.search(r"^loader: rank 0/1 \| .* samples/s", first, re.M), first
    # The second run resumes after step 5 and goes past the end of the epoch (step 12) ...
    second = train(data, "--steps", "15", "--ckpt-dir", "ckpt-a")
    assert re.match(r"resumed from ckpt-a/checkpoint_\S+_full_step0+5 \(step 5\)\n", second)
    assert "step 6:" not in second and "step 15: loss" in second
    # ... and ends exactly where one run of 15 steps does: the same weights, the same samples.
    straight = train(data, "--steps", "15", "--ckpt-dir", "ckpt-b")
    assert last_loss(second, 15) == last_loss(straight, 15)
    ckpts = sorted(p.name for p in (data / "ckpt-a").glob("checkpoint_*"))
    assert len(ckpts) == 2 and ckpts[-1].endswith("_full_step000000000000014"), ckpts  # keep 2


def test_train_under_torchrun_resumes_on_two_ranks(data: pathlib.Path) -> None:
    first = train(data, "--steps", "3", "--ckpt-dir", "ckpt-ddp")  # one rank ...
    assert "done: 3 steps" in first
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", str(EXAMPLES / "train.py")]  # fmt: skip
    out = run([*torchrun, "--data", "out/", "--batch-size", "8", "--ckpt-every", "3",
               "--log-every", "3", "--steps", "9", "--ckpt-dir", "ckpt-ddp"], data)  # fmt: skip
    for rank in ("0", "1"):  # ... then two, from the one rank's checkpoint (step 2)
        who = rf"rank {rank}/2: "
        assert re.search(rf"^{who}resumed from \S+_full_step0+2 \(step 2\)$", out, re.M), out
        for step in (6, 9):
            assert re.search(rf"^{who}step {step}: loss \d+\.\d{{4}}$", out, re.M), out
        last_loss(out, 9, who)
        assert re.search(rf"^{who}loader: rank {rank}/2 \| ", out, re.M), out
    ckpt = sorted((data / "ckpt-ddp").glob("checkpoint_*"))[-1]
    assert ckpt.name.endswith("_full_step000000000000008")
    assert len(list(ckpt.glob("*_rank0000[01].pt*"))) == 2  # both ranks wrote their file


def test_mix_draws_at_the_weights(data: pathlib.Path) -> None:
    out = run([sys.executable, str(EXAMPLES / "mix.py"), "train-ds/", "val-ds/", "--weights",
               "3", "1", "--steps", "4", "--batch-size", "8"], data)  # fmt: skip
    # train-ds (56 samples) at 3/4 is the first to run out: 75 samples an epoch (56 + 19)
    assert "mix of 75 samples an epoch, weights {'train-ds': 0.75, 'val-ds': 0.25}" in out, out
    assert re.search(r"^4 steps, last loss \d+\.\d{4}; the batches held \[\d+, \d+\]$", out, re.M)
    match = re.search(r"^drawn: (\{.*?\}) \(shares", out, re.M)
    assert match, out
    drawn = ast.literal_eval(match.group(1))
    assert sum(drawn.values()) == 32 and abs(drawn["train-ds"] - 24) <= 2, drawn
    held = ast.literal_eval(re.search(r"the batches held (\[.*?\])", out).group(1))  # type: ignore[union-attr]
    assert held == [drawn["train-ds"], drawn["val-ds"]]


def test_malformed_values_are_one_line_errors(data: pathlib.Path) -> None:
    """A malformed rank variable (train.py) or job size (slurm.sh, before sbatch): one line
    naming it, no traceback, nothing run through bash arithmetic."""
    env = {**os.environ, "RANK": "-1", "WORLD_SIZE": "2"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train.py"), "--data", "out/", "--steps", "1"],
        cwd=data, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("train: RANK='-1' is not a whole number"), proc.stderr
    assert "Traceback" not in proc.stderr
    marker = data / "ran"
    env = {**os.environ, "NODES": f"a[$(touch {marker})]"}
    proc = subprocess.run(
        ["bash", str(EXAMPLES / "slurm.sh")],
        cwd=data, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "slurm.sh: error: NODES=" in proc.stderr and "not a whole number" in proc.stderr
    assert not marker.exists()
