"""Check what a ShardWriter is given: its label map, and each sample (key, members, label).

A sample is a mapping in WebDataset's shape: ``__key__`` (the sample key), one entry per
member (``"jpg": b"..."``; a ``str`` is written as UTF-8) and, for a labelled dataset, ``cls``
(the class index, or the class name when the writer was given ``classes``). Keys and
extensions are written as given, so they must already be what every reader splits alike:
ASCII letters, digits and ``_-+,=@~%`` (``/`` between the parts of a key), never a dot
(WebDataset readers split a member name at the first dot of its last component, so an
extension such as ``seg.png`` is written ``seg_png``) nor a space (DALI's index is
space-separated).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardio.errors import FormatError, UsageError
from shardio.format.checksum import member_xxh3_64
from shardio.format.spec import LABEL_EXT

__all__ = [
    "MAX_EXT_CHARS",
    "MAX_KEY_CHARS",
    "MAX_LABEL",
    "WrittenSample",
    "check_classes",
    "check_sample",
]

_PART = r"[A-Za-z0-9_\-+,=@~%]+"  # pack's keys: these, and %XX for any other byte
_KEY_RE = re.compile(rf"^{_PART}(?:/{_PART})*$")
_EXT_RE = re.compile(rf"^{_PART}$")  # the index's extension table: no dot (docs/format.md)
MAX_KEY_CHARS = 1024
MAX_EXT_CHARS = 128
MAX_LABEL = 2**31 - 1  # labels are int32 in the index and in HDF5 shards
_KEY_FIELD = "__key__"


@dataclass(frozen=True)
class WrittenSample:
    """A checked sample: its key, its label (-1: none) and its members ``(ext, data, xxh3_64)``.

    ``members`` holds the label's ``cls`` member last when the sample is labelled.
    """

    key: str
    label: int
    members: tuple[tuple[str, bytes, int], ...]

    @property
    def data_bytes(self) -> int:
        """The members' payload bytes."""
        return sum(len(data) for _, data, _ in self.members)


def _check_key(key: object, number: int) -> str:
    where = f"sample {number:,}"
    if not isinstance(key, str):
        raise UsageError(f"{where}: __key__ must be a str, got {type(key).__name__}")
    shown = repr(key[:80]) + ("..." if len(key) > 80 else "")
    if len(key) > MAX_KEY_CHARS:
        raise UsageError(f"{where}: key {shown} is longer than {MAX_KEY_CHARS} characters")
    if not _KEY_RE.match(key):
        raise UsageError(
            f"{where}: key {shown} is not a shardio key: use ASCII letters, digits and "
            "_-+,=@~%, with / between parts (no dot, space or empty part: readers split "
            "member names at the first dot)"
        )
    return key


def _check_ext(ext: object, key: str) -> str:
    if not isinstance(ext, str):
        raise UsageError(f"sample {key!r}: member name {ext!r} is not a str")
    if ext.startswith("__"):
        raise UsageError(
            f"sample {key!r}: {ext!r} is reserved (names starting with __ are fields readers "
            "add, such as __key__, not members)"
        )
    if len(ext) > MAX_EXT_CHARS or not _EXT_RE.match(ext):
        raise UsageError(
            f"sample {key!r}: member name {ext[:80]!r} is not an extension shardio writes: use "
            f"up to {MAX_EXT_CHARS} ASCII letters, digits and _-+,=@~% (no dot: seg.png -> seg_png)"
        )
    return ext


def _payload(value: object, key: str, ext: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)  # a copy: the caller may reuse its buffer once write() returns
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate (e.g. from os.fsdecode)
            raise FormatError(
                f"sample {key!r}: member {ext!r} is a str that is not valid Unicode "
                f"({exc.reason} at character {exc.start:,}, {value[exc.start]!r}): give bytes, "
                "or a str that UTF-8 can write"
            ) from exc
    raise UsageError(
        f"sample {key!r}: member {ext!r} is a {type(value).__name__}: give bytes (or a str, "
        "written as UTF-8); encode arrays and images before writing them"
    )


def _label(value: object, key: str, classes: Sequence[str] | None) -> int:
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("ascii")
        except UnicodeDecodeError:
            value = repr(value)
    if isinstance(value, str):
        if classes is not None and value in classes:
            return list(classes).index(value)
        if not (value.isascii() and value.isdigit() and (value == "0" or value[0] != "0")):
            known = " or a name from classes=" if classes is not None else ""
            raise UsageError(
                f"sample {key!r}: label {value[:40]!r} is not a class index (0, 1, ...){known}"
            )
        value = int(value[:12])
    if isinstance(value, bool) or not isinstance(value, int):
        if type(value).__module__ == "numpy" and hasattr(value, "__index__"):
            value = int(value)
        else:
            raise UsageError(
                f"sample {key!r}: label cls must be an int class index, got {type(value).__name__}"
            )
    limit = len(classes) - 1 if classes is not None else MAX_LABEL
    if not 0 <= value <= limit:
        what = f"{len(classes)} classes" if classes is not None else f"at most {MAX_LABEL}"
        raise UsageError(f"sample {key!r}: label {value} is out of range ({what})")
    return value


def check_sample(
    sample: object, number: int, *, labelled: bool | None, classes: Sequence[str] | None
) -> WrittenSample:
    """Check ``sample`` (the ``number``-th written) and turn it into members to write.

    Args:
        sample: the mapping given to :meth:`ShardWriter.write`.
        number: how many samples were written before it (for messages).
        labelled: whether samples carry ``cls``; None: not decided yet (the first sample
            decides).
        classes: the label map given to the writer, if any.

    Raises:
        UsageError: not a mapping, a bad key, a reserved or malformed member name, a member
            that is not bytes or str, no member, or a label missing, unexpected or out of
            range; the message names the sample.
        FormatError: a str member that UTF-8 cannot write (a lone surrogate); the message
            names the sample and the member.
    """
    if not isinstance(sample, Mapping):
        raise UsageError(
            f"sample {number:,} is a {type(sample).__name__}: give a dict such as "
            '{"__key__": "000001", "jpg": data, "cls": 3}'
        )
    if _KEY_FIELD not in sample:
        raise UsageError(f"sample {number:,} has no __key__")
    key = _check_key(sample[_KEY_FIELD], number)
    members: list[tuple[str, bytes, int]] = []
    label = -1
    has_label = False
    for ext, value in sample.items():
        if ext == _KEY_FIELD:
            continue
        if ext == LABEL_EXT:
            label, has_label = _label(value, key, classes), True
            continue
        data = _payload(value, key, _check_ext(ext, key))
        members.append((ext, data, member_xxh3_64(data)))
    if not members:
        raise UsageError(f"sample {key!r} has no member to write (only {sorted(sample)!r})")
    if labelled is True and not has_label:
        raise UsageError(
            f"sample {key!r} has no {LABEL_EXT!r} label, but this dataset is labelled (the "
            "first sample had one, or classes= was given): give every sample its label"
        )
    if labelled is False and has_label:
        raise UsageError(
            f"sample {key!r} has a {LABEL_EXT!r} label, but the first sample had none: a "
            "dataset is labelled throughout or not at all"
        )
    if has_label:
        data = b"%d" % label
        members.append((LABEL_EXT, data, member_xxh3_64(data)))
    return WrittenSample(key, label, tuple(members))


def check_classes(classes: Sequence[str] | None) -> tuple[str, ...] | None:
    """The label map a ShardWriter was given (class index -> name), checked."""
    if classes is None:
        return None
    if isinstance(classes, (str, bytes)) or not isinstance(classes, Sequence):
        raise UsageError("classes must be a list of class names (str), index order")
    names = tuple(classes)
    if not names:
        raise UsageError("classes is empty: give the class names, or None for no label map")
    for name in names:
        if not isinstance(name, str) or not name or "\0" in name or "\n" in name:
            raise UsageError(f"class name {name!r} must be a non-empty str on one line")
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise UsageError(f"class {dup!r} appears twice in classes")
    return names
