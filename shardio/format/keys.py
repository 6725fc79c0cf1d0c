"""Map source paths (arbitrary bytes) to WebDataset sample keys and member names, reversibly.

A WebDataset reader splits a member name at the first dot of its last path component: the
part before is the sample key, the part after the extension. Source names may hold several
dots, spaces, non-ASCII or non-UTF-8 bytes, so shardio percent-encodes every byte outside a
small safe set (``.`` included) in the key and in the extension. The result is plain ASCII
with no dot and no space: safe for tar headers, for DALI's space-separated ``.idx`` files and
for every WebDataset reader. The original path is kept in the index besides, so nothing relies
on decoding keys.
"""

from __future__ import annotations

__all__ = ["decode_component", "encode_component", "split_name"]

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-+,=@~")
_ENCODE_TABLE = [chr(b) if b in _SAFE else f"%{b:02X}" for b in range(256)]


def encode_component(raw: bytes, *, keep_slash: bool = False) -> str:
    """Percent-encode bytes into a dot-free, space-free ASCII string.

    Args:
        raw: the bytes to encode (a file name, a relative directory, an extension).
        keep_slash: keep ``/`` literally, for relative paths whose directories should stay
            readable in the key.
    """
    table = _ENCODE_TABLE
    if keep_slash:
        return "/".join("".join(table[b] for b in part) for part in raw.split(b"/"))
    return "".join(table[b] for b in raw)


def decode_component(text: str) -> bytes:
    """Invert :func:`encode_component`."""
    out = bytearray()
    data = text.encode("ascii")
    i = 0
    while i < len(data):
        if data[i] == 0x25:  # '%'
            out.append(int(data[i + 1 : i + 3], 16))
            i += 3
        else:
            out.append(data[i])
            i += 1
    return bytes(out)


def split_name(name: bytes) -> tuple[bytes, bytes]:
    """Split a file name into (stem, extension) at its last dot.

    A leading dot belongs to the stem (``.hidden`` has no extension), as does a name ending
    in a dot.
    """
    dot = name.rfind(b".")
    if dot <= 0 or dot == len(name) - 1:
        return name, b""
    return name[:dot], name[dot + 1 :]
