"""``shardio inspect`` as a library function: what a dataset is, where it lies, how it is read.

``inspect_dataset(path)`` opens the dataset (its manifest and index, checked), asks the
filesystem holding it what it is and how shards are laid out now, and returns a
:class:`DatasetInfo`; :meth:`DatasetInfo.to_json` is what ``shardio inspect --json`` prints.
The CLI writes the text form from the same object.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from shardio.format.label_source import LabelSource
from shardio.format.manifest import Manifest
from shardio.format.spec import CLASSES_SHOWN
from shardio.read.reader import ShardReader
from shardio.read.strategy import StrategyChoice, choose_strategy
from shardio.storage.striping import describe_layout

__all__ = ["CLASSES_SHOWN", "DatasetInfo", "inspect_dataset", "label_map_json", "parity_json"]


@dataclass(frozen=True)
class DatasetInfo:
    """A dataset as ``shardio inspect`` shows it.

    Attributes:
        path: the dataset directory, as given.
        manifest: its manifest (checked).
        extensions: the member extensions of its index, sorted.
        read_choice: the filesystem holding it now and the read strategy reads would use
            here (``SHARDIO_READ_STRATEGY`` included).
        stripe_layout: the shard directory's layout now, as the filesystem tells it.
    """

    path: str
    manifest: Manifest
    extensions: tuple[str, ...]
    read_choice: StrategyChoice
    stripe_layout: str

    def to_json(self) -> dict[str, Any]:
        """The ``inspect --json`` document."""
        man, choice = self.manifest, self.read_choice
        return {
            "path": self.path,
            "format_version": man.format_version,
            "shard_format": man.shard_format,
            "samples": man.num_samples,
            "members": man.num_members,
            "shards": len(man.shards),
            "data_bytes": man.data_bytes,
            "total_bytes": man.total_bytes,
            "extensions": list(self.extensions),
            "label_layout": man.label_layout,
            "classes": len(man.classes) if man.classes is not None else 0,
            "label_map": label_map_json(man.classes, man.label_layout, man.label_source),
            "filesystem": choice.fs.name,  # now, where inspect runs
            "filesystem_detail": {
                "name": choice.fs.name,
                "description": choice.fs.describe(),
                "network": choice.fs.network,
                "mount_point": choice.fs.mount_point,
                "mount_type": choice.fs.mount_type,
                "source": choice.fs.source,
            },
            "read_strategy": {
                "name": choice.strategy.name,
                "reason": choice.reason,
                "description": choice.strategy.describe(),
            },
            "stripe_layout": self.stripe_layout,
            # What pack recorded (fs_type, action, stripe, commands, message); null if nothing.
            "pack_layout": dict(man.layout) or None,
            "created_by": man.created_by,
            "parity": parity_json(man),
        }


def inspect_dataset(path: str | os.PathLike[str]) -> DatasetInfo:
    """Open the dataset at ``path`` and describe it.

    Raises:
        FormatError: not a dataset, or its manifest or index is damaged (naming the file).
        StorageError: it cannot be read.
    """
    root = os.fspath(path)
    with ShardReader(root) as ds:
        choice = choose_strategy(root)
        return DatasetInfo(
            path=root,
            manifest=ds.manifest,
            extensions=tuple(sorted(ds.index.exts)),
            read_choice=choice,
            stripe_layout=describe_layout(os.path.join(root, "shards"), fs_type=choice.fs.name),
        )


def parity_json(man: Manifest) -> dict[str, object] | None:
    """The parity for ``--json`` output (scheme, groups, bytes, overhead); None: no parity."""
    section = man.parity
    if section is None:
        return None
    return {
        "scheme": section.scheme,
        "groups": len(section.groups),
        "cell_bytes": section.cell_bytes,
        "backend": section.backend,
        "parity_bytes": section.total_bytes,
        "overhead": round(section.total_bytes / man.total_bytes, 4) if man.total_bytes else 0.0,
    }


def label_map_json(
    classes: tuple[str, ...] | None, layout: str, source: LabelSource | None
) -> dict[str, object] | None:
    """The label map for ``--json`` output: its size, first classes, origin; None: no map."""
    if classes is None:
        return None
    return {
        "num_classes": len(classes),
        "layout": layout,
        "first": [{"index": i, "name": n} for i, n in enumerate(classes[:CLASSES_SHOWN])],
        "source": source.to_json() if source is not None else {"kind": "class-dirs"},
    }
