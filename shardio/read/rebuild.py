"""The rebuild step of recovery for a dataset with parity: the default ``rebuild`` hook.

:class:`ParityRebuild` rebuilds a damaged, missing or stalled source shard from the other
files of its parity group (:func:`shardio.parity.dataset.rebuild_files`), read through the
reader's own opener (so a survivor on a dead server costs one deadline, then another
survivor is read; a survivor held after a stall is tried again, under the deadline, since a
dead server's stall can hold a whole mount for a while), and publishes it over the bad file
in the dataset, on the servers that are alive. The group's lock makes the ranks and workers
that hit the same shard at once rebuild it once: the others wait (at most
``lock_timeout_s``) and find it rebuilt. The shard is then read again and checked like any
other read before a byte of it is used.

The dataset must be writable by the job (it is the dataset's own directory, shardio's
files); where it is not, the rebuild fails with the reason and the policy decides.
"""

from __future__ import annotations

from shardio.read.packed import PackedDataset

__all__ = ["LOCK_TIMEOUT_S", "ParityRebuild", "parity_rebuild_for"]

LOCK_TIMEOUT_S = 300.0


class ParityRebuild:
    """``rebuild(shard) -> bool`` from the parity of the dataset ``ds`` reads."""

    def __init__(self, ds: PackedDataset, *, lock_timeout_s: float = LOCK_TIMEOUT_S) -> None:
        self.ds = ds
        self.lock_timeout_s = lock_timeout_s
        # Whether the last call wrote the shard (False: it was intact when the group's lock
        # was had: rebuilt by another process meanwhile, or held only for a mount-wide stall).
        self.wrote = False

    def __call__(self, shard: int) -> bool:
        from shardio.parity.dataset import rebuild_files

        manifest = self.ds.manifest
        section = manifest.parity
        if section is None:
            return False
        entry = manifest.shards[shard]
        # Survivors held after a stall are tried too, under the deadline: a dead server's
        # stall may have held healthy shards of the same mount for a while.
        trying = getattr(self.ds.opener, "trying_held", None)
        done = rebuild_files(
            self.ds.root,
            manifest,
            section.group_of(shard),
            [entry.path],
            opener=trying() if trying is not None else self.ds.opener,
            durable=True,
            lock_timeout_s=self.lock_timeout_s,
        )
        self.wrote = bool(done.rebuilt)
        return True

    def __repr__(self) -> str:
        return f"ParityRebuild({self.ds.root!r})"


def parity_rebuild_for(ds: PackedDataset) -> ParityRebuild | None:
    """The default hook for ``ds``: one when its dataset has parity and is read in place
    (a staging area opened directly holds no parity: its source is repaired by
    ``shardio verify --repair``)."""
    manifest = ds.manifest
    if manifest.parity is None or manifest.staged_from is not None:
        return None
    return ParityRebuild(ds)
