"""ResilientDataset: the older spelling of ``ShardDataset(path, recovery=...)``, kept one
release (it goes in shardio 0.3; CHANGELOG.md).

Recovery is asked for one way, ``ShardDataset(path, recovery="skip")`` or
``recovery=RecoveryPolicy(...)``: see :mod:`shardio.read.recovery` for the steps and
:mod:`shardio.runtime.recovering` for how the dataset reads through them.
``ResilientDataset`` is a plain function now (no class, no metaclass): it warns and returns
a :class:`~shardio.runtime.dataset.ShardDataset`, which is what ``type()`` says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardio._deprecated import warn_renamed
from shardio.errors import UsageError
from shardio.read.recovery import RecoveryPolicy
from shardio.runtime.dataset import ShardDataset, recovering_copy

__all__ = ["ResilientDataset"]


def ResilientDataset(  # noqa: N802 - the name users know, kept one release
    dataset: ShardDataset,
    *,
    policy: str | RecoveryPolicy = "raise",
    rebuild: Callable[[int], bool] | None = None,
    **options: Any,
) -> ShardDataset:
    """Deprecated: write ``ShardDataset(path, recovery=...)``.

    Returns a copy of ``dataset`` (a ShardDataset, in its mode; ``dataset`` is left
    unchanged) reading through a recovery policy: ``policy`` ("raise" or "skip", or a full
    :class:`RecoveryPolicy`), with RecoveryPolicy's fields as ``options`` when ``policy`` is
    a string, and ``rebuild`` as ShardDataset's.

    Raises:
        UsageError: ``dataset`` is not a ShardDataset, or a bad policy.
    """
    warn_renamed("ResilientDataset(ds, policy=...)", "ShardDataset(path, recovery=...)")
    if not isinstance(dataset, ShardDataset):
        raise UsageError(f"ResilientDataset wraps a ShardDataset, got {type(dataset).__name__}")
    return recovering_copy(dataset, policy, rebuild=rebuild, options=options)
