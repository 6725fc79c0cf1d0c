"""Pinned label maps: read one from a classes file or a packed dataset, validated.

A pinned map fixes the class index of every class name across splits (``pack --classes
FILE`` or ``pack --labels-from DATASET``): the scan then takes the indices from it instead of
from the sorted class directories, and refuses a class directory the map lacks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import xxhash

from shardio.errors import FormatError, StorageError, UsageError, wrap_os_error
from shardio.format.identity import load_identified
from shardio.format.label_source import LabelSource
from shardio.format.spec import MANIFEST_FILENAME
from shardio.storage.files import read_regular

__all__ = ["MAX_CLASSES_FILE_BYTES", "PinnedLabels", "load_classes_file", "load_dataset_labels"]

# 1,000,000 classes of 60 bytes: a file larger than this is not a list of class names.
MAX_CLASSES_FILE_BYTES = 64 * 1024 * 1024
_NAME_MAX = 255  # bytes of one directory name (NAME_MAX on Linux)
_CONTROL = {*range(32), 127}


@dataclass(frozen=True)
class PinnedLabels:
    """A label map fixed before the scan: class index = position in ``classes``.

    Attributes:
        classes: the class names, in index order.
        source: where the map came from (recorded in the manifest).
        option: how it was given, for messages: ``--classes FILE``, ``--labels-from DS``.
    """

    classes: tuple[str, ...]
    source: LabelSource
    option: str


def _dir_name_problem(name: str) -> str:
    """Why ``name`` cannot be the name of a directory, or "" when it can."""
    if not name:
        return "is empty"
    if "/" in name or name in (".", ".."):
        return "is not a directory name"
    try:
        raw = os.fsencode(name)
    except UnicodeError:
        return "is not a file name this system can spell"
    if len(raw) > _NAME_MAX:
        return f"is longer than {_NAME_MAX} bytes"
    return ""


def _typed_name_problem(name: str) -> str:
    """Why a name typed into a classes file cannot be a class directory's, or ""."""
    if name != name.strip():
        return "has leading or trailing white space"
    if any(ord(c) in _CONTROL for c in name):
        return "holds a control character"
    if name.startswith(".") and name not in (".", ".."):
        return "is a hidden name (hidden directories are never classes)"
    return _dir_name_problem(name)


def load_classes_file(path: str) -> PinnedLabels:
    """Read a classes file: UTF-8 text, one class name per line, index = line number - 1.

    A trailing newline, a UTF-8 byte order mark and CRLF line ends are accepted.

    Raises:
        UsageError: the file is not UTF-8, has an empty line, a name twice, a name that
            cannot be a class directory, or no names; the message names the file and line.
        FormatError: the file is larger than :data:`MAX_CLASSES_FILE_BYTES`.
        StorageError: the file is missing, unreadable or not a regular file.
    """
    what = "classes file"
    data = read_regular(path, max_bytes=MAX_CLASSES_FILE_BYTES, what=what)
    digest = xxhash.xxh3_128_hexdigest(data)
    body = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = body.count(b"\n", 0, exc.start) + 1
        raise UsageError(f"{what} {path}, line {line}: not UTF-8 text") from exc
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise UsageError(f"{what} {path} holds no class names (one per line)")
    seen: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        name = raw[:-1] if raw.endswith("\r") else raw
        if not name.strip():
            raise UsageError(f"{what} {path}, line {number} is empty: one class name per line")
        problem = _typed_name_problem(name)
        if problem:
            raise UsageError(f"{what} {path}, line {number}: class {name!r} {problem}")
        if name in seen:
            raise UsageError(
                f"{what} {path}, line {number}: class {name!r} is listed already on line "
                f"{seen[name]}"
            )
        seen[name] = number
    source = LabelSource(kind="classes-file", path=os.path.abspath(path), xxh3_128=digest)
    return PinnedLabels(tuple(seen), source, f"--classes {path}")


def load_dataset_labels(path: str) -> PinnedLabels:
    """The label map of a packed dataset (a dataset or staging area directory).

    Raises:
        UsageError: PATH is not a directory, or its dataset has no label map.
        FormatError: its manifest is damaged or not one this shardio reads.
        StorageError: its manifest cannot be read (or is not a regular file).
    """
    option = f"--labels-from {path}"
    if not os.path.isdir(path):
        raise UsageError(f"{option}: not a directory (give a packed dataset's directory)")
    manifest_path = os.path.join(path, MANIFEST_FILENAME)
    if not os.path.lexists(manifest_path):
        raise UsageError(f"{option}: {manifest_path} does not exist (not a packed dataset)")
    try:
        manifest, ident = load_identified(path)
    except FormatError as exc:
        raise FormatError(f"{option}: {exc}") from exc
    except StorageError as exc:
        raise wrap_os_error(exc, f"{option}: {exc}") from exc
    if manifest.classes is None:
        raise UsageError(
            f"{option}: {path} has no label map (it was packed without labels), so it cannot "
            "pin one"
        )
    for i, name in enumerate(manifest.classes):
        problem = _dir_name_problem(name)
        if problem:
            raise FormatError(f"{option}: {manifest_path}: class {i} {name!r} {problem}")
    source = LabelSource(kind="dataset", path=os.path.abspath(path), xxh3_128=ident)
    return PinnedLabels(manifest.classes, source, option)
