"""A manifest document's bytes: canonical JSON, sealed by a checksum as its last field."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import xxhash

from shardio.errors import FormatError
from shardio.format.spec import MANIFEST_CHECKSUM_FIELD

__all__ = ["check_document_checksum", "encode_document"]

_CHECKSUM_RE = re.compile(
    rb'\n "' + MANIFEST_CHECKSUM_FIELD.encode() + rb'": "([0-9a-f]{32})"\n}\n\Z'
)


def encode_document(doc: Mapping[str, Any]) -> bytes:
    """Serialise a manifest document; a format-2 document gets its checksum filled in.

    The checksum is the xxh3-128 of the serialised document with the checksum's own value
    as 32 zeros; it is the document's last field, so a reader finds it at a fixed place.
    """
    if MANIFEST_CHECKSUM_FIELD not in doc:
        return (json.dumps(doc, indent=1) + "\n").encode("ascii")
    # The field is zeroed and moved last whatever the caller passed (a loaded document
    # carries its old checksum).
    doc = {k: v for k, v in doc.items() if k != MANIFEST_CHECKSUM_FIELD}
    doc[MANIFEST_CHECKSUM_FIELD] = "0" * 32
    data = (json.dumps(doc, indent=1) + "\n").encode("ascii")
    match = _CHECKSUM_RE.search(data)
    if match is None:
        raise FormatError(f"{MANIFEST_CHECKSUM_FIELD} must be the last field of the manifest")
    digest = xxhash.xxh3_128_hexdigest(data).encode("ascii")
    return data[: match.start(1)] + digest + data[match.end(1) :]


def check_document_checksum(data: bytes, where: str) -> None:
    """Check the checksum a format-2 document carries as its last field.

    Raises:
        FormatError: it is missing, malformed or does not match.
    """
    match = _CHECKSUM_RE.search(data)
    if match is None:
        raise FormatError(
            f"{where}: the manifest's own checksum ({MANIFEST_CHECKSUM_FIELD}, its last field) "
            "is missing or malformed: the file was edited or truncated"
        )
    zeroed = data[: match.start(1)] + b"0" * 32 + data[match.end(1) :]
    actual = xxhash.xxh3_128_hexdigest(zeroed)
    if actual != match.group(1).decode("ascii"):
        raise FormatError(
            f"{where}: manifest checksum mismatch (expected {match.group(1).decode()}, got "
            f"{actual}): the file was edited or damaged"
        )
