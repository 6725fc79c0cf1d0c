"""A mix's label map: the labelled sources of a mix must mean the same classes.

Labelled sources with different label maps (``ds.classes``) are refused unless ``classes=``
gives the mix's map, into which each source's labels are then remapped by class name
(:func:`label_maps`); :func:`remap` maps a label, :func:`described` names a map in a message.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shardio.errors import UsageError
from shardio.format.spec import LABEL_EXT

if TYPE_CHECKING:
    from shardio.runtime.dataset import ShardDataset

__all__ = ["check_classes", "described", "label_maps", "remap", "show_classes"]

_SHOWN_CLASSES = 6  # class names of a label map shown in a message


def show_classes(classes: Sequence[str]) -> str:
    """A label map for a one-line message: its first names and its size."""
    shown = ", ".join(repr(c) for c in classes[:_SHOWN_CLASSES])
    more = ", ..." if len(classes) > _SHOWN_CLASSES else ""
    return f"[{shown}{more}] ({len(classes)} classes)"


def described(classes: object) -> str:
    """A saved or current label map for a message."""
    if classes is None:
        return "no labels"
    if isinstance(classes, list) and all(isinstance(c, str) for c in classes):
        return f"label map {show_classes(classes)}"
    return f"label map {type(classes).__name__}"


def first_difference(a: Sequence[str], b: Sequence[str]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"class {i} is {x!r} in one, {y!r} in the other"
    return f"one has {len(a)} classes, the other {len(b)}"


def label_maps(
    datasets: Sequence[ShardDataset], classes: Sequence[str] | None
) -> tuple[tuple[str, ...] | None, tuple[tuple[int, ...] | None, ...]]:
    """The mix's label map and, per source, the table from its labels to the mix's (None:
    unchanged).

    Raises:
        UsageError: labelled sources with different maps and no ``classes``; a bad
            ``classes``, or one that lacks a class of a source.
    """
    maps = [ds.classes for ds in datasets]
    labelled = [(s, found) for s, found in enumerate(maps) if found is not None]
    if classes is None:
        for s, mine in labelled[1:]:
            t, first = labelled[0]
            if mine != first:
                raise UsageError(
                    f"sources {t} ({datasets[t].path}) and {s} ({datasets[s].path}) of the mix "
                    f"have different label maps, {show_classes(first)} and "
                    f"{show_classes(mine)} ({first_difference(first, mine)}): one cls would "
                    "mean two classes; give the mix's map as classes=[...] to remap them"
                )
        return (labelled[0][1] if labelled else None), (None,) * len(datasets)
    wanted = check_classes(classes)
    if not labelled:
        raise UsageError("classes= remaps the sources' labels, but no source of the mix has any")
    position = {name: i for i, name in enumerate(wanted)}
    tables: list[tuple[int, ...] | None] = []
    for s, found in enumerate(maps):
        if found is None:
            tables.append(None)
            continue
        missing = [name for name in found if name not in position]
        if missing:
            raise UsageError(
                f"source {s} of the mix ({datasets[s].path}) has classes that classes= lacks: "
                f"{show_classes(missing)}"
            )
        table = tuple(position[name] for name in found)
        tables.append(None if table == tuple(range(len(table))) else table)
    return wanted, tuple(tables)


def check_classes(classes: object) -> tuple[str, ...]:
    """``classes`` as a label map: a non-empty list of distinct, non-empty strings.

    Raises:
        UsageError: naming what is wrong.
    """
    if not isinstance(classes, Sequence) or isinstance(classes, str | bytes):
        raise UsageError(f"classes must be a list of class names, got {type(classes).__name__}")
    if not classes:
        raise UsageError("classes must name at least one class, got none")
    seen: set[str] = set()
    for i, name in enumerate(classes):
        if not isinstance(name, str) or not name:
            raise UsageError(f"classes[{i}] must be a non-empty string, got {name!r}")
        if name in seen:
            raise UsageError(f"classes holds {name!r} twice")
        seen.add(name)
    return tuple(classes)


def remap(s: int, sample: dict[str, Any], table: tuple[int, ...]) -> int:
    """Sample ``sample``'s label (of source ``s``) in the mix's map, by ``table``.

    Raises:
        UsageError: the label is not an integer, or outside the source's map.
    """
    label = sample[LABEL_EXT]
    key = sample.get("__key__")
    if isinstance(label, bool) or not isinstance(label, numbers.Integral):
        raise UsageError(
            f"sample {key!r} of source {s} of the mix has a {LABEL_EXT!r} of type "
            f"{type(label).__name__}: classes= remaps integer labels (a transform must "
            "keep it one)"
        )
    if not 0 <= int(label) < len(table):
        raise UsageError(
            f"sample {key!r} of source {s} of the mix has label {int(label)}, outside its "
            f"label map of {len(table)} classes"
        )
    return table[int(label)]
