"""Deprecation warnings: a renamed name or option keeps working for one release, and says so.

Every alias the CHANGELOG lists goes through :func:`warn_renamed`, so the message has one
shape (old, new, the release that removes the old) and points at the caller's line.
"""

from __future__ import annotations

import warnings
from typing import TypeVar, cast

from shardio.errors import UsageError

__all__ = ["REMOVED_IN", "renamed_option", "warn_renamed"]

T = TypeVar("T")

# The release whose code no longer has the aliases (CHANGELOG.md lists them).
REMOVED_IN = "0.3"


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn (``DeprecationWarning``) that ``old`` is now spelled ``new``.

    Args:
        old: what the caller wrote, e.g. ``"ShardDataset(cache=...)"``.
        new: what to write instead, e.g. ``"ShardDataset(stage=...)"``.
        stacklevel: frames above this call to name in the warning (3: the caller of the
            function that calls this one).
    """
    warnings.warn(
        f"{old} is deprecated and goes in shardio {REMOVED_IN}: use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_option(where: str, old: str, old_value: object, new: str, new_value: T) -> T:
    """The value of an option renamed from ``old`` to ``new``: ``new_value``, or
    ``old_value`` with a warning; both given is refused.

    Raises:
        UsageError: both spellings were given.
    """
    if old_value is None:
        return new_value
    if new_value is not None:
        raise UsageError(f"{where}: give {new}= only ({old}= is its old name)")
    warn_renamed(f"{where}({old}=...)", f"{where}({new}=...)", stacklevel=4)
    return cast(T, old_value)  # the old spelling takes what the new one does
