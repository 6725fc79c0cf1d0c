"""Helpers of the checkpoint tests: states whose every value says which step made them."""

from __future__ import annotations

import torch


def state_of(step: int, *, mib: float = 0.25) -> dict:
    """A state that is different at every step (fp32 and bf16 weights, plain values)."""
    gen = torch.Generator().manual_seed(step)
    n = int(mib * (1 << 20) / 4)
    return {
        "model": {"w": torch.randn(n, generator=gen), "b": torch.full((7,), float(step))},
        "half": torch.randn(64, generator=gen).to(torch.bfloat16),
        "optimizer": {"lr": 0.1, "step": step, "betas": (0.9, 0.99)},
        "note": f"step {step}",
    }


def assert_state(got: dict, step: int, *, mib: float = 0.25) -> None:
    want = state_of(step, mib=mib)
    assert torch.equal(got["model"]["w"], want["model"]["w"])
    assert torch.equal(got["model"]["b"], want["model"]["b"])
    assert torch.equal(got["half"], want["half"]) and got["half"].dtype == torch.bfloat16
    assert got["optimizer"] == want["optimizer"] and got["note"] == want["note"]


JOB = {"SLURM_JOB_ID": "1001"}
