"""Which dataset a staging area holds, and the checks that bind an area to its dataset.

An area's marker records the dataset id (:mod:`shardio.format.identity`: the xxh3-128 of
the source manifest's bytes) of what was staged into it. Staging another dataset into it,
reading it as another dataset's cache (``stage=``) and repairing it from another dataset are
refused, never done with another dataset's bytes. An area of an older release has no id in
its marker: it is identified by its staged manifest (the source's manifest plus
``staged_from``), which must equal the dataset's own manifest but for that field.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from dataclasses import dataclass

from shardio.errors import FormatError, UsageError
from shardio.format.identity import is_dataset_id, load_identified, short_id
from shardio.format.manifest import Manifest, load_manifest
from shardio.format.spec import MANIFEST_FILENAME
from shardio.staging.protocol import STAGE_DIR, read_area_marker
from shardio.storage.files import describe_kind

__all__ = [
    "DatasetIdentity",
    "area_dataset_id",
    "cache_problem",
    "check_area_holds",
    "describe_area",
    "identity_of",
    "same_dataset",
    "source_identity",
    "source_mismatch",
]


@dataclass(frozen=True)
class DatasetIdentity:
    """What a dataset is: its id when known, and its manifest (to compare with an area of an
    older release, whose marker records no id).

    Attributes:
        dataset_id: the dataset id; None for a staging area of an older release.
        manifest: the dataset's manifest (a staging area's names its source).
        where: the dataset's directory, for messages.
    """

    dataset_id: str | None
    manifest: Manifest
    where: str

    def describe(self) -> str:
        """``dataset 1a2b3c4d5e6f (/lustre/a/train)``, for one-line messages."""
        source = self.manifest.staged_from or self.where
        ident = short_id(self.dataset_id) if self.dataset_id is not None else "of an older release"
        return f"dataset {ident} ({source})"


def area_dataset_id(dest: str) -> str | None:
    """The dataset id the marker of area ``dest`` records; None without a marker or an id
    (an area of an older release)."""
    marker = read_area_marker(dest)
    found = marker.get("dataset_id") if marker is not None else None
    return found if is_dataset_id(found) else None


def identity_of(root: str, manifest: Manifest, manifest_id: str) -> DatasetIdentity:
    """The identity of the dataset read from ``root``: ``manifest_id`` (the id of the bytes
    of its manifest) for a packed dataset; for a staging area, the id its marker records
    (its manifest is the source's plus ``staged_from``, so its own bytes are not the id)."""
    if manifest.staged_from is None:
        return DatasetIdentity(manifest_id, manifest, root)
    return DatasetIdentity(area_dataset_id(root), manifest, root)


def _without_source(manifest: Manifest) -> bytes:
    return dataclasses.replace(manifest, staged_from=None).dumps()


def _staged_manifest(dest: str) -> Manifest | None:
    """The manifest staged in area ``dest``; None when there is none (or not a regular file,
    or unreadable: nothing to tell the dataset by)."""
    path = os.path.join(dest, MANIFEST_FILENAME)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        return load_manifest(path)
    except (OSError, FormatError):
        return None


def same_dataset(dest: str, ident: DatasetIdentity) -> bool | None:
    """Whether area ``dest`` holds the dataset ``ident``; None when that cannot be told (an
    area of an older release, or one whose stage was killed early, with no staged manifest).

    By the marker's id when both ids are known, else by the staged manifest.
    """
    held = area_dataset_id(dest)
    if held is not None and ident.dataset_id is not None:
        return held == ident.dataset_id
    staged = _staged_manifest(dest)
    if staged is None:
        return None
    return _without_source(staged) == _without_source(ident.manifest)


def describe_area(dest: str) -> str:
    """``dataset 1a2b3c4d5e6f (/lustre/a/train)``: what area ``dest`` holds, for messages."""
    held = area_dataset_id(dest)
    marker = read_area_marker(dest) or {}
    source = marker.get("staged_from")
    staged = _staged_manifest(dest)
    if staged is not None and staged.staged_from:
        source = staged.staged_from
    ident = short_id(held) if held is not None else "of an older release"
    return f"dataset {ident} ({source if isinstance(source, str) else 'source unknown'})"


def check_area_holds(dest: str, ident: DatasetIdentity, *, action: str) -> None:
    """Refuse to use area ``dest`` for ``ident`` when it holds another dataset.

    Args:
        dest: a staging area.
        ident: the dataset it is used for.
        action: what would be done ("read it as that dataset's cache"), for the message.

    Raises:
        UsageError: the area holds another dataset, or one that cannot be told apart.
    """
    same = same_dataset(dest, ident)
    if same:
        return
    if same is None:
        raise UsageError(
            f"staging area {dest} does not say which dataset it holds (staged by an older "
            f"release and never finished), so it cannot be checked against "
            f"{ident.describe()}: refusing to {action}; clean it (shardio stage --clean "
            f"{dest}) or stage into it again"
        )
    raise UsageError(
        f"staging area {dest} holds {describe_area(dest)}, not {ident.describe()}: refusing "
        f"to {action}"
    )


def cache_problem(cache: str) -> str | None:
    """Why ``cache`` cannot serve reads now (missing, not a directory, empty, not a staging
    area), or None when it is a staging area (whose dataset is then checked)."""
    try:
        st = os.stat(cache)
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return f"is a {describe_kind(st.st_mode)}, not a staging area"
    if read_area_marker(cache) is not None:
        return None
    staged = _staged_manifest(cache)
    if staged is not None and staged.staged_from is not None:
        return None  # an area of an older release (no marker)
    try:
        entries = [e for e in os.listdir(cache) if e != STAGE_DIR]
    except OSError as exc:
        return f"cannot be listed ({exc.strerror})"
    if staged is not None:
        return "is a packed dataset, not a staging area"
    return "is empty" if not entries else "is not a staging area (no .shardio-stage marker)"


def source_identity(source: str) -> DatasetIdentity:
    """The identity of the dataset at ``source`` (its manifest read once).

    Raises:
        FormatError: no valid manifest there.
        StorageError: it cannot be read.
    """
    manifest, manifest_id = load_identified(source)
    return identity_of(source, manifest, manifest_id)


def source_mismatch(dest: str, source: str) -> str | None:
    """Why the source area ``dest`` falls back to no longer holds its dataset (re-packed or
    replaced since it was staged), or None (the same dataset, or it cannot be told: a
    missing source manifest is reported shard by shard)."""
    try:
        ident = source_identity(source)
    except (OSError, FormatError):
        return None
    if same_dataset(dest, ident) is not False:
        return None
    return (
        f"the source {source} now holds {ident.describe()}, not the {describe_area(dest)} "
        "staged here: it cannot stand in for these copies"
    )
