"""Checkpoints of model and data together: atomic, verified, Zstandard-compressed, async.

- ``save(state, DIR, kind=, step=)``: one checkpoint, now;
- ``load_latest(DIR)``: the newest intact one (falls back, says what it skipped); or
  ``load_latest(DIR/checkpoint_...)``: that one checkpoint, and no other;
- ``Checkpointer(DIR, full_every_s=, light_every_s=, keep_full=, keep_light=)``: in the
  background, on a cadence (``maybe_save``) or when asked (``save``).

Modules: ``naming`` (host, job, rank, kind and step in every name), ``manifest`` (the sealed
manifest), ``codec`` (torch.save + zstd + xxh3-128, streamed), ``loadable`` (what a state may
hold: what ``torch.load(weights_only=True)`` loads back), ``snapshot`` (the state copied
to host memory), ``store`` (temp directory, commit), ``catalog`` (listing, checking, pruning),
``lease`` (one live job per directory), ``ranks`` (torch.distributed when initialized),
``writing`` (one save's steps), ``save_now``, ``load`` and ``saver``. Nothing is imported
with the package; torch only when a state is saved or loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardio._lazy import lazy_face

if TYPE_CHECKING:
    from shardio.checkpoint.load import Checkpoint, load_latest
    from shardio.checkpoint.save_now import save
    from shardio.checkpoint.saver import Checkpointer
    from shardio.checkpoint.writing import SaveOptions

__all__ = ["Checkpoint", "Checkpointer", "SaveOptions", "load_latest", "save"]

__getattr__, __dir__ = lazy_face(
    __name__,
    {
        "Checkpoint": "shardio.checkpoint.load",
        "load_latest": "shardio.checkpoint.load",
        "save": "shardio.checkpoint.save_now",
        "Checkpointer": "shardio.checkpoint.saver",
        "SaveOptions": "shardio.checkpoint.writing",
    },
)
