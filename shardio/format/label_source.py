"""Where a pinned label map came from: the manifest's optional ``labels.source``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardio.errors import FormatError
from shardio.format.fields import get_field

__all__ = ["LABEL_SOURCE_KINDS", "LabelSource"]

_HEX128 = re.compile(r"[0-9a-f]{32}")

LABEL_SOURCE_KINDS = ("classes-file", "dataset")


@dataclass(frozen=True, kw_only=True)
class LabelSource:
    """Where a pinned label map came from (the manifest's optional ``labels.source``).

    A manifest without one took its label map from the class directories of the tree it
    was packed from.

    Attributes:
        kind: "classes-file" (``pack --classes FILE``) or "dataset" (``pack --labels-from``).
        path: the file or dataset as given to pack, made absolute (for people).
        xxh3_128: of the classes file's bytes, or of the dataset's manifest.json: what
            identifies the map (the path does not).
    """

    kind: str
    path: str
    xxh3_128: str

    def __post_init__(self) -> None:
        if self.kind not in LABEL_SOURCE_KINDS:
            raise FormatError(f"labels.source: unknown kind {self.kind!r}")
        if not self.path or "\0" in self.path:
            raise FormatError("labels.source: path must be a path")
        if not _HEX128.fullmatch(self.xxh3_128):
            raise FormatError("labels.source: xxh3_128 must be 32 lower-case hex digits")

    @property
    def identity(self) -> tuple[str, str]:
        """What identifies the map: its kind and digest, not the path it was read by."""
        return self.kind, self.xxh3_128

    def to_json(self) -> dict[str, str]:
        """The JSON object."""
        return {"kind": self.kind, "path": self.path, "xxh3_128": self.xxh3_128}

    @classmethod
    def from_json(cls, doc: object, where: str) -> LabelSource:
        """Validate a JSON object."""
        if not isinstance(doc, dict):
            raise FormatError(f"{where}: labels.source must be an object")
        w = f"{where}: labels.source"
        return cls(
            kind=get_field(doc, "kind", str, w),
            path=get_field(doc, "path", str, w),
            xxh3_128=get_field(doc, "xxh3_128", str, w),
        )
