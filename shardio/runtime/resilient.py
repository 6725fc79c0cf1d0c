"""ResilientDataset: a ShardDataset that survives read faults (retry, re-stage, rebuild, skip).

``ResilientDataset(ShardDataset(path, cache=stage), policy="skip")`` returns a copy of the
dataset with a recovery policy given to its reader (the same as
``ShardDataset(path, cache=stage, recovery="skip")``, or ``ds.with_recovery("skip")``): it
reads exactly like the dataset it was made from (map or stream mode, in DataLoader workers,
with ``ds.loader(...)``, ranks and exact resume) and applies a
:class:`~shardio.read.recovery.RecoveryPolicy` to every sample that fails, to be read or to be
decoded (a :class:`~shardio.errors.SampleDecodeError`): see :mod:`shardio.read.recovery` for
the steps and :mod:`shardio.runtime.recovering` for how the dataset reads through it. Workers
send their recovery events with the batches; the training process counts them in
``recovery_stats`` (a view of the rank's read metrics).

``isinstance(ds, ResilientDataset)`` holds for any ShardDataset with a recovery policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardio.errors import UsageError
from shardio.read.recovery import RecoveryPolicy
from shardio.runtime.dataset import ShardDataset

__all__ = ["ResilientDataset"]


class _Recovering(type):
    """ResilientDataset's type: calling it returns a ShardDataset with a recovery policy,
    which is what ``isinstance`` checks for."""

    def __call__(
        cls,
        dataset: ShardDataset,
        *,
        policy: str | RecoveryPolicy = "raise",
        rebuild: Callable[[int], bool] | None = None,
        **options: Any,
    ) -> ShardDataset:
        if not isinstance(dataset, ShardDataset):
            raise UsageError(f"ResilientDataset wraps a ShardDataset, got {type(dataset).__name__}")
        return dataset.with_recovery(policy, rebuild=rebuild, **options)

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, ShardDataset) and obj.recovering is not None


class ResilientDataset(metaclass=_Recovering):
    """Wrap a ShardDataset so that faults are recovered from, substituted, or raised clearly.

    Returns a copy of ``dataset`` (a ShardDataset, in its mode) reading through a recovery
    policy; ``dataset`` is left unchanged.

    Args:
        dataset: the ShardDataset to read (map or stream mode).
        policy: "raise" or "skip", or a full :class:`RecoveryPolicy`.
        rebuild: rebuilds a damaged source shard in place (``rebuild(shard_index) -> bool``),
            tried after the retries (at once for a shard whose read stalled); None: from the
            dataset's parity when it has some (``pack --parity``), else no rebuild.
        **options: fields of :class:`RecoveryPolicy` (retries, backoff_s, max_backoff_s,
            restage, budget_s, max_substitutes, journal) when ``policy`` is a string.

    The dataset returned has ``recovery_policy`` (the policy in force), ``recovery_events``
    (the events seen by the training process, the last 10,000, each a dict as in the
    journal, from every worker) and ``recovery_stats``.
    """
