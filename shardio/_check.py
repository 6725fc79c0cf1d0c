"""Argument checkers: integers, seconds, bools and paths as users pass them, refused in one
line when wrong. One checker per kind of value, one limit per kind."""

from __future__ import annotations

import math
import operator
import os

from shardio.errors import UsageError

__all__ = ["MAX_SECONDS", "require_bool", "require_int", "require_path", "require_seconds"]

# Every duration an option takes (deadlines, intervals, back-offs, lingers) is at most a day:
# anything longer is a typo, and past threading.TIMEOUT_MAX a wait overflows.
MAX_SECONDS = 86_400.0

_NP_BOOLS = frozenset({"bool", "bool_"})


def require_int(
    value: object, what: str, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """Return ``value`` as an int, refusing floats, strings and bools.

    Python and numpy integers (and anything with ``__index__``, e.g. a 0-d integer tensor)
    pass: ``1.5`` or ``np.float64(2.0)`` would otherwise be truncated into another sample.

    Raises:
        UsageError: not an integer, or outside [``minimum``, ``maximum``]; the message names
            ``what``.
    """
    kind = type(value)
    # numpy's bool is told by its module and name: this module imports no numpy.
    if isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in _NP_BOOLS):
        raise UsageError(f"{what} must be an integer, not a bool ({value!r})")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError as exc:
        raise UsageError(
            f"{what} must be an integer, got {type(value).__name__} {value!r}"
        ) from exc
    if minimum is not None and number < minimum:
        raise UsageError(f"{what} must be at least {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise UsageError(f"{what} must be at most {maximum}, got {number}")
    return int(number)


def require_bool(value: object, what: str) -> bool:
    """Return ``value`` when it is True or False (numpy's bool too).

    ``"no"``, ``0`` or ``None`` are refused rather than taken for their truth: ``"no"`` is
    true.

    Raises:
        UsageError: not a bool; the message names ``what``.
    """
    kind = type(value)
    if isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in _NP_BOOLS):
        return bool(value)
    raise UsageError(f"{what} must be True or False, got {kind.__name__} {value!r}")


def require_path(value: object, what: str) -> str:
    """Return ``value`` (a str or ``os.PathLike``) as a str path.

    Raises:
        UsageError: not a path (a dict passed where the directory goes, bytes, None), empty,
            or with a NUL character; the message names ``what``.
    """
    if not isinstance(value, (str, os.PathLike)):
        raise UsageError(f"{what} must be a path (str or os.PathLike), got {type(value).__name__}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise UsageError(f"{what} must be a str path, got {type(path).__name__}")
    if not path:
        raise UsageError(f"{what} must not be empty")
    if "\0" in path:
        raise UsageError(f"{what} {path!r} has a NUL character")
    return path


def require_seconds(value: object, what: str, *, positive: bool = False) -> float:
    """Return ``value`` (an int or a float) as seconds in [0, :data:`MAX_SECONDS`], or in
    (0, :data:`MAX_SECONDS`] with ``positive``.

    Raises:
        UsageError: a bool, a string, None, NaN, infinity, a negative number, zero where
            ``positive``, or more than a day; the message names ``what``.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UsageError(
            f"{what} must be a number of seconds, got {type(value).__name__} {value!r}"
        )
    # The comparison is False for NaN and needs no float() of a huge int.
    if not (value > 0 if positive else value >= 0) or not value <= MAX_SECONDS:
        low = "more than 0" if positive else "at least 0"
        raise UsageError(f"{what} must be seconds, {low} and at most a day, got {_shown(value)}")
    seconds = float(value)
    if not math.isfinite(seconds):  # pragma: no cover - excluded by the bounds above
        raise UsageError(f"{what} must be a finite number of seconds, got {_shown(value)}")
    return seconds


def _shown(value: object) -> str:
    """``value`` as an error message shows it: at most 40 characters (a huge int is cut)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
