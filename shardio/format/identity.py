"""The identity of a dataset: the xxh3-128 of its manifest file's bytes (its dataset id).

A checksum proves bytes, not provenance: whatever is derived from a dataset (a staging area,
a cache given to a reader, a checkpoint of a position in it) records this id and is checked
against it before use. The id is of the bytes of the file as packed, so two datasets with the
same directory name, or one dataset re-packed in place, have different ids, and a
byte-for-byte copy has the same one.

The id is a function of the samples, not of the parity side files: a manifest with a parity
section (``shardio parity add``) has the id of the same manifest with ``"parity": null``,
which is what ``parity drop`` writes back; so protecting a dataset, or dropping its parity,
changes no id, and a checkpoint's position or a staging area stays the dataset's. (A dataset
of format 1 or 2 is rewritten in format 3 by its first ``parity add``, which adds checksums
to its manifest: its id changes once then.) Manifests without parity keep the id of their
bytes, so the ids recorded by earlier releases stay valid.
"""

from __future__ import annotations

import json
import os

import xxhash

from shardio.errors import FormatError
from shardio.format.document import encode_document
from shardio.format.manifest import Manifest, load_manifest, parse_manifest
from shardio.format.spec import MANIFEST_FILENAME, MAX_MANIFEST_BYTES
from shardio.storage.files import read_regular

__all__ = ["dataset_id", "dataset_id_of", "is_dataset_id", "load_identified", "short_id"]

_ID_CHARS = frozenset("0123456789abcdef")


def dataset_id_of(data: bytes) -> str:
    """The dataset id of a manifest's bytes (32 hex digits): of the bytes as they are, or,
    for a manifest with a parity section, as they are with ``"parity": null``."""
    return xxhash.xxh3_128_hexdigest(_without_parity(data))


def _without_parity(data: bytes) -> bytes:
    """``data`` with its parity section nulled (its checksum renewed); ``data`` itself when
    it has none, or is not a manifest this can rewrite (the parser then says what is wrong)."""
    if b'"parity"' not in data:
        return data
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return data
    if not isinstance(doc, dict) or doc.get("parity") is None:
        return data
    doc["parity"] = None
    try:
        return encode_document(doc)
    except (FormatError, ValueError, TypeError):
        return data


def is_dataset_id(value: object) -> bool:
    """Whether ``value`` is a well-formed dataset id (32 lower-case hex digits)."""
    return isinstance(value, str) and len(value) == 32 and set(value) <= _ID_CHARS


def short_id(value: str) -> str:
    """The first 12 hex digits of a dataset id, for messages."""
    return value[:12]


def load_identified(root: str | os.PathLike[str]) -> tuple[Manifest, str]:
    """Read the manifest of the dataset at ``root`` once: (the manifest, its dataset id).

    The id is of the very bytes that were parsed, so a manifest replaced meanwhile (a
    ``pack --force``) cannot pair one dataset's manifest with another's id.

    Raises:
        FormatError: no manifest, or not a valid one (as :func:`load_manifest`).
        StorageError: it is not a regular file, too large, or unreadable.
    """
    path = os.path.join(os.fspath(root), MANIFEST_FILENAME)
    if not os.path.lexists(path):
        load_manifest(path)  # raises its one "no manifest" error
    data = read_regular(path, max_bytes=MAX_MANIFEST_BYTES, what="manifest")
    return parse_manifest(data, where=path), dataset_id_of(data)


def dataset_id(root: str | os.PathLike[str]) -> str:
    """The dataset id of the dataset at ``root`` (its directory): the xxh3-128 of its
    ``manifest.json``, checked to be a valid manifest.

    Raises:
        FormatError: no manifest, or not a valid one.
        StorageError: it is not a regular file, too large, or unreadable.
    """
    return load_identified(root)[1]
