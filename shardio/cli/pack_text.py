"""How a pack reads on the terminal: label maps, source-call counts, escaped names
(shared by ``shardio pack``, ``merge`` and ``inspect``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from shardio.cli.common import one_line
from shardio.format.spec import CLASSES_SHOWN

if TYPE_CHECKING:
    from shardio.format.label_source import LabelSource
    from shardio.packing.calls import SourceCalls

__all__ = ["calls_text", "label_map_text", "show_name", "show_path"]


def _origin_text(source: LabelSource | None, layout: str) -> str:
    if layout == "writer":
        return "given to ShardWriter"
    if source is None:
        return "from the class directories"
    if source.kind == "dataset":
        return f"pinned by --labels-from {source.path}"
    return f"pinned by --classes {source.path}"


def label_map_text(classes: tuple[str, ...], layout: str, source: LabelSource | None) -> str:
    """``4 classes (class-dirs) from the class directories: 0 cat, 1 dog, ...``."""
    shown = ", ".join(f"{i} {show_name(n)}" for i, n in enumerate(classes[:CLASSES_SHOWN]))
    more = ", ..." if len(classes) > CLASSES_SHOWN else ""
    count = f"{len(classes):,} class{'es' if len(classes) != 1 else ''}"
    return f"{count} ({layout}) {_origin_text(source, layout)}: {shown}{more}"


def show_name(name: str) -> str:
    """A class name for the terminal: undecodable bytes and control characters escaped."""
    try:
        raw = os.fsencode(name)
    except UnicodeError:  # a lone surrogate that no file name decodes to
        raw = name.encode("utf-8", "backslashreplace")
    return one_line(show_path(raw))


def calls_text(calls: SourceCalls, note: str = "") -> str:
    """``1,001 directory listings (1,001,000 entries), 1,000,000 stat calls, ...``."""
    return (
        f"{calls.dirs_listed:,} directory listings ({calls.entries_seen:,} entries{note}), "
        f"{calls.stat_calls:,} stat calls, {calls.opens:,} opens, {calls.fstat_calls:,} fstat"
    )


def show_path(path: bytes) -> str:
    """A source path for the terminal: undecodable bytes as escapes, never an exception."""
    return path.decode("utf-8", "backslashreplace")
