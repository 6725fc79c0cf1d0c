"""ShardLoader: the DataLoader shardio recommends, with exact mid-epoch resume.

Batches are built inside the workers (one shared-memory buffer per batch) and delivered in a
deterministic order. The loader counts the samples it has handed to the training loop, so
``state_dict()`` taken after step k resumes at the first sample not yet delivered, including
those that sat in prefetch queues when the job died.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Sampler

from shardio.errors import UsageError
from shardio.runtime.dataset import (
    EVENTS_KEY,
    ShardDataset,
    WorkerFailure,
    labels_to_tensor,
    require_int,
)

__all__ = ["ShardLoader"]


def _identity(batch: Any) -> Any:
    return batch


class _PositionSampler(Sampler[int]):
    def __init__(self, positions: np.ndarray[Any, Any]) -> None:
        self.positions = positions

    def __iter__(self) -> Iterator[int]:
        return iter(self.positions.tolist())

    def __len__(self) -> int:
        return len(self.positions)


class ShardLoader:
    """Iterate batches of a ShardDataset; resumable mid-epoch.

    Args:
        dataset: the ShardDataset (map or stream mode).
        batch_size: samples per batch (an int >= 1).
        num_workers: DataLoader worker processes (an int >= 0).
        drop_last: drop this rank's last incomplete batch.
        **kwargs: passed to ``torch.utils.data.DataLoader`` (pin_memory, prefetch_factor,
            multiprocessing_context, ...). ``persistent_workers`` is refused: workers must
            see each epoch's start position.
    """

    def __init__(
        self,
        dataset: ShardDataset,
        *,
        batch_size: int,
        num_workers: int = 0,
        drop_last: bool = False,
        **kwargs: Any,
    ) -> None:
        batch_size = require_int(batch_size, "batch_size", minimum=1)
        num_workers = require_int(num_workers, "num_workers", minimum=0)
        if kwargs.get("persistent_workers"):
            raise UsageError("ShardLoader does not support persistent_workers")
        if kwargs.get("in_order") is False:
            raise UsageError("ShardLoader needs in_order=True: resume relies on the order")
        for key in ("sampler", "batch_sampler", "shuffle", "collate_fn", "batch_size"):
            if key in kwargs:
                raise UsageError(f"ShardLoader sets {key} itself; pass it to ShardDataset")
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.kwargs = kwargs
        self._delivered = 0
        self._epoch = dataset.epoch  # the epoch _delivered counts samples of

    def _sync_epoch(self) -> None:
        # ds.set_epoch() called directly (the DistributedSampler habit) starts a new epoch.
        if self.dataset.epoch != self._epoch:
            self._delivered = 0
            self._epoch = self.dataset.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (a new one reshuffles and starts at its beginning)."""
        self.dataset.set_epoch(epoch)
        self._sync_epoch()

    def __len__(self) -> int:
        n = self.dataset.samples_per_rank()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _dataloader(self, positions: np.ndarray[Any, Any]) -> DataLoader[Any]:
        common: dict[str, Any] = {"num_workers": self.num_workers, **self.kwargs}
        if self.num_workers > 0:
            common.setdefault("prefetch_factor", 4)
        if self.dataset.mode == "stream":
            usable = len(positions)
            if self.drop_last:
                usable = usable // self.batch_size * self.batch_size
            self.dataset._stream_plan = (positions[:usable], self.batch_size)
            return DataLoader(self.dataset, batch_size=None, collate_fn=_identity, **common)
        return DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=_PositionSampler(positions),
            drop_last=self.drop_last,
            collate_fn=_identity,
            **common,
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._sync_epoch()
        world = self.dataset.ranks().world_size
        base = self.dataset._consumed + self._delivered * world
        self.dataset._consumed, self._delivered = base, 0
        positions = self.dataset.rank_indices(consumed=base)
        try:
            for batch in self._dataloader(positions):
                if isinstance(batch, WorkerFailure):
                    raise batch.error
                events = batch.pop(EVENTS_KEY, None)
                if events is not None:
                    absorb = getattr(self.dataset, "absorb_events", None)
                    if absorb is not None:
                        absorb(events)
                self._delivered += len(batch["__key__"])
                yield labels_to_tensor(batch)
        finally:
            self.dataset._stream_plan = None

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch stands: global positions delivered to the training loop."""
        self._sync_epoch()
        world = self.dataset.ranks().world_size
        return self.dataset._state(self.dataset._consumed + self._delivered * world)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`, also with another number of ranks."""
        self.dataset.load_state_dict(state)
        self._delivered = 0
        self._epoch = self.dataset.epoch
