"""Strict parsing of the integers and switches shardio takes from environment variables.

A rank read wrong is wrong data, silently: ``SLURM_PROCID=-1`` once read as "rank 0 of 1"
made that rank read the whole dataset. So every rank, count or switch variable (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``SLURM_PROCID``, ``SLURM_NTASKS_PER_NODE``,
``SHARDIO_PIN_WORKERS``, ...) goes through this one parser: ASCII digits only, no sign,
space, underscore or leading zero, at most 9 digits; anything else is refused in one line that
names the variable and shows its value (truncated). Python's ``int()`` and ``str.isdigit()``
are not used on such text: both accept digits of other scripts (``"٣"``, ``"²"``), spaces,
signs and underscores.

Library code takes the environment as a mapping (read only in ``shardio.cli``), so the
functions here take one too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from shardio.errors import UsageError

__all__ = [
    "MAX_ENV_INT",
    "env_flag",
    "env_int",
    "parse_env_int",
    "parse_tasks_per_node",
    "shown_value",
]

MAX_ENV_INT = 999_999_999  # 9 digits: far beyond any job's ranks, nodes or CPUs
_INT = re.compile(r"0|[1-9][0-9]{0,8}")  # [0-9] is ASCII in Python's re; fullmatch only
_SHOWN = 40  # characters of a bad value shown in a message
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def shown_value(value: str) -> str:
    """``value`` as a message shows it: quoted, escaped, and cut after 40 characters."""
    if len(value) <= _SHOWN:
        return repr(value)
    return f"{value[:_SHOWN]!r}... ({len(value):,} characters)"


def parse_env_int(name: str, value: str, *, minimum: int = 0, maximum: int = MAX_ENV_INT) -> int:
    """The integer of ``name=value``, or a :class:`UsageError` naming both.

    Raises:
        UsageError: ``value`` is not ASCII digits (no sign, space, underscore or leading
            zero, at most 9 digits), or lies outside ``[minimum, maximum]``.
    """
    if _INT.fullmatch(value) is None:
        raise UsageError(
            f"{name}={shown_value(value)} is not a whole number: expected ASCII digits "
            f"0-{MAX_ENV_INT} (no sign, space or leading zero)"
        )
    number = int(value)
    if not minimum <= number <= maximum:
        raise UsageError(f"{name}={value} is out of range: expected {minimum} to {maximum}")
    return number


def env_int(
    env: Mapping[str, str], name: str, *, minimum: int = 0, maximum: int = MAX_ENV_INT
) -> int | None:
    """``env[name]`` parsed by :func:`parse_env_int`; None when the variable is not set.

    A variable set to the empty string is malformed, not absent: an empty ``SLURM_PROCID``
    must not make a rank of a multi-rank job read as a single rank.
    """
    value = env.get(name)
    if value is None:
        return None
    return parse_env_int(name, value, minimum=minimum, maximum=maximum)


def env_flag(env: Mapping[str, str], name: str, *, default: bool) -> bool:
    """A switch: 1/true/yes/on or 0/false/no/off (any case); ``default`` when not set.

    Raises:
        UsageError: any other value.
    """
    value = env.get(name)
    if value is None:
        return default
    word = value.lower() if value.isascii() else value
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise UsageError(f"{name}={shown_value(value)} is not a switch: use 1 or 0 (true/false)")


_TASKS = re.compile(r"(0|[1-9][0-9]{0,8})(?:\(x(0|[1-9][0-9]{0,8})\))?")


def parse_tasks_per_node(name: str, value: str) -> int | None:
    """Ranks per node from SLURM's task count text: ``"8"``, or the compressed per-node list
    SLURM writes (``"2(x3)"``: 2 tasks on each of 3 nodes; ``"4,2"``; ``"4(x2),2"``).

    Returns:
        The count when every node has the same one (``"2(x3)"``, ``"4,4"`` give 2 and 4);
        None when nodes differ (``"4,2"``): no single "ranks per node" exists.

    Raises:
        UsageError: malformed text, or a count of 0.
    """
    parts = value.split(",")
    counts: set[int] = set()
    for part in parts:
        match = _TASKS.fullmatch(part)
        if match is None or len(parts) > 4096:
            raise UsageError(
                f"{name}={shown_value(value)} is not a task count: expected N, or SLURM's "
                "per-node list such as 2(x3) or 4,2"
            )
        counts.add(int(match.group(1)))
        if match.group(1) == "0" or match.group(2) == "0":
            raise UsageError(f"{name}={value}: a node cannot run 0 tasks")
    return counts.pop() if len(counts) == 1 else None
