"""What a save lets through is exactly what load_latest (weights_only=True) loads back."""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from checkpointing import JOB, state_of

from shardio.checkpoint import Checkpointer, load_latest, save
from shardio.errors import UsageError

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _training_state() -> dict:
    """What training scripts save every day, besides tensors."""
    np.random.seed(7)
    return {
        "model": {"w": torch.arange(6.0)},
        "numpy_rng": np.random.get_state(),
        "loss": np.float64(1.25),
        "epoch": np.int64(3),
        "flag": np.bool_(True),
        "history": np.linspace(0.0, 1.0, 5, dtype=np.float32),
        "generator": np.random.default_rng(3).bit_generator.state,
        "empty": {"bytes": b"", "array": np.empty(0)},  # each refused by torch alone
        "torch_rng": torch.Generator().manual_seed(7).get_state(),
    }


def _assert_training_state(got: dict) -> None:
    want = _training_state()
    assert torch.equal(got["model"]["w"], want["model"]["w"])
    name, keys, pos, has_gauss, cached = got["numpy_rng"]
    assert name == "MT19937" and (keys == want["numpy_rng"][1]).all()
    assert (pos, has_gauss, cached) == want["numpy_rng"][2:]
    np.random.set_state(got["numpy_rng"])  # usable as it is
    assert got["loss"] == 1.25 and type(got["loss"]) is np.float64
    assert got["epoch"] == 3 and type(got["epoch"]) is np.int64
    assert got["flag"] is np.True_
    assert got["history"].dtype == np.float32 and (got["history"] == want["history"]).all()
    assert got["generator"] == want["generator"]
    assert got["empty"]["bytes"] == b"" and got["empty"]["array"].shape == (0,)
    assert torch.equal(got["torch_rng"], want["torch_rng"])


def test_numpy_rng_and_scalars_round_trip_under_weights_only(ckdir: pathlib.Path) -> None:
    save(_training_state(), ckdir, step=1, environ=JOB)
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([np.dtype])  # the caller's own, kept after a load
    try:
        _assert_training_state(load_latest(ckdir).state)
        # Only what the load added is taken back: what the caller allowed stays allowed.
        assert set(torch.serialization.get_safe_globals()) == {*before, np.dtype}
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


@pytest.mark.slow
def test_numpy_state_loads_in_a_fresh_process(ckdir: pathlib.Path) -> None:
    with Checkpointer(ckdir, environ=JOB) as saver:
        saver.save(_training_state(), step=2)
    code = (
        "import sys; sys.path[:0] = [sys.argv[2], sys.argv[3]]\n"
        "from shardio.checkpoint import load_latest\n"
        "from test_save_state_types import _assert_training_state\n"
        "ck = load_latest(sys.argv[1])\n"
        "_assert_training_state(ck.state)\n"
        "print('step', ck.step)\n"
    )
    here = str(pathlib.Path(__file__).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(ROOT / "tests")
    env.update(JOB)  # the same job, restarted
    done = subprocess.run(
        [sys.executable, "-c", code, str(ckdir), str(ROOT), here],
        check=False, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["step", "2"]


class Custom:
    """A class of the training script."""


Point = collections.namedtuple("Point", "x y")


class Tagged(torch.Tensor):
    """A tensor subclass."""


def _cycle() -> dict:
    state: dict = {"a": []}
    state["a"].append(state)
    return state


@pytest.mark.parametrize(
    ("state", "where", "what"),
    [
        ({"args": argparse.Namespace(lr=0.1)}, "state['args']", "argparse.Namespace"),
        ({"rng": np.random.default_rng(1)}, "state['rng']", "numpy.random._generator.Generator"),
        ({"opt": {"state": {0: {"x": Custom()}}}}, "state['opt']['state'][0]['x']", "Custom"),
        ({"p": [1, Point(1, 2)]}, "state['p'][1]", "Point"),
        ({"labels": np.array([1, "a"], dtype=object)}, "state['labels']", "dtype object"),
        ({"t": torch.zeros(2).as_subclass(Tagged)}, "state['t']", "tensor subclasses"),
        ({"f": lambda: 1}, "state['f']", "function"),
        ({(1, Custom()): 1}, "state[(1, ", "(a key)"),
        (_cycle(), "state['a'][0]", "itself"),
    ],
)
def test_a_state_load_would_refuse_is_refused_at_save(
    ckdir: pathlib.Path, state: dict, where: str, what: str
) -> None:
    before = save(state_of(1), ckdir, step=1, environ=JOB)
    with pytest.raises(UsageError) as info:
        save(state, ckdir, step=2, environ=JOB)
    message = str(info.value)
    assert message.startswith(f"cannot save {where}") and what in message
    assert "\n" not in message
    assert load_latest(ckdir).path == before  # nothing else saved, nothing left behind
    assert not [p for p in ckdir.iterdir() if p.name.startswith(".checkpoint")]


def test_the_checkpointer_refuses_at_the_call_and_goes_on(ckdir: pathlib.Path) -> None:
    with Checkpointer(ckdir, environ=JOB) as saver:
        with pytest.raises(UsageError, match=r"cannot save state\['cfg'\] \(argparse"):
            saver.save({"cfg": argparse.Namespace(lr=0.1)}, step=1)
        assert not saver.busy  # refused before anything was copied or started
        saver.save({"cfg": vars(argparse.Namespace(lr=0.1))}, step=2)
    ck = load_latest(ckdir)
    assert (ck.step, ck.state) == (2, {"cfg": {"lr": 0.1}})


class _Loader:
    dataset_id = None

    def state_dict(self) -> dict:
        return {"epoch": 1, "sampler": Custom()}


def test_a_loader_state_load_would_refuse_is_refused(ckdir: pathlib.Path) -> None:
    with pytest.raises(UsageError, match=r"cannot save the loader's state_dict\(\)\['sampler'\]"):
        save({"w": torch.ones(1)}, ckdir, step=1, loader=_Loader(), environ=JOB)
    with (
        Checkpointer(ckdir, environ=JOB, loader=_Loader()) as saver,
        pytest.raises(UsageError, match="sampler"),
    ):
        saver.save({"w": torch.ones(1)}, step=1)


def test_nesting_past_what_pickle_takes_is_refused_in_one_line(ckdir: pathlib.Path) -> None:
    deep: list = []
    inner = deep
    for _ in range(5000):
        inner.append([])
        inner = inner[0]
    with pytest.raises(UsageError, match="nested more than 200 deep") as info:
        save({"deep": deep}, ckdir, step=1, environ=JOB)
    assert len(str(info.value)) < 400


def _sparse_state() -> dict:
    dense = torch.zeros(40, 30)
    dense[3, 4], dense[17, 0], dense[39, 29] = 1.5, -2.0, 7.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        csr = dense.to_sparse_csr()
    coo = dense.to_sparse()
    uncoalesced = torch.sparse_coo_tensor(
        torch.tensor([[0, 0], [1, 1]]), torch.tensor([1.0, 2.0]), (2, 2)
    )
    return {"coo": coo, "again": coo, "csr": csr, "uncoalesced": uncoalesced, "dense": dense}


def _assert_sparse(got: dict) -> None:
    want = _sparse_state()
    assert got["coo"].layout == torch.sparse_coo and got["csr"].layout == torch.sparse_csr
    for key in ("coo", "csr", "uncoalesced"):
        assert torch.equal(got[key].to_dense(), want[key].to_dense()), key
    assert got["again"] is got["coo"]  # one tensor found twice stays one
    assert torch.equal(got["dense"], want["dense"])


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")
def test_sparse_tensors_round_trip(ckdir: pathlib.Path) -> None:
    save(_sparse_state(), ckdir, step=1, environ=JOB)
    _assert_sparse(load_latest(ckdir).state)
    with Checkpointer(ckdir, environ=JOB, reuse_buffers=True) as saver:
        for step in (2, 3):  # the second copy reuses the first's buffers
            saver.save(_sparse_state(), step=step)
            saver.wait()
    ck = load_latest(ckdir)
    assert ck.step == 3
    _assert_sparse(ck.state)
