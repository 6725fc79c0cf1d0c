"""SLURM's compressed host lists (``gpu[001-004,007],login1``), expanded strictly and bounded.

What ``SLURM_JOB_NODELIST`` and ``SLURM_STEP_NODELIST`` hold, read without calling
``scontrol``: comma-separated hosts, each a name with bracketed ranges (``node[1-3]``;
several brackets multiply: ``r[1-2]n[01-02]`` is r1n01, r1n02, r2n01, r2n02). A range keeps
the width of its lower bound (``[08-10]``: 08, 09, 10; ``[8-10]``: 8, 9, 10). Names are
ASCII letters, digits, ``.``, ``_`` and ``-``. The hosts come out in the order written (the
order SLURM numbers the nodes in: ``SLURM_NODEID`` indexes this list).

Anything else is refused in one line naming the variable: an empty list or item, a bracket
left open, a range written high to low, a number of more than 9 digits, a host named twice,
more than :data:`MAX_HOSTS` hosts (counted before any is written out, so
``n[0-999999999]`` costs nothing).
"""

from __future__ import annotations

import re

from shardio.errors import UsageError

__all__ = ["MAX_HOSTS", "expand_hostlist"]

MAX_HOSTS = 65_536  # more nodes than any job has; a list beyond it is a mistake
_MAX_TEXT = 1 << 20  # characters of a host list read (SLURM's own are far shorter)
_NAME = re.compile(r"[A-Za-z0-9._-]*")
_RANGE = re.compile(r"([0-9]{1,9})(?:-([0-9]{1,9}))?")


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 60 else f"{text[:60]!r}... ({len(text):,} characters)"


def _split_top(text: str, what: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise UsageError(f"{what}: a bracket inside a bracket")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise UsageError(f"{what}: ']' without '['")
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise UsageError(f"{what}: '[' without ']'")
    items.append(text[start:])
    return items


def _ranges(body: str, what: str) -> list[tuple[int, int, int]]:
    """The (low, high, width) of each range of a bracket's ``body``."""
    out = []
    for part in body.split(","):
        found = _RANGE.fullmatch(part)
        if found is None:
            raise UsageError(f"{what}: a bracket holds {part!r}, not N or N-M")
        low_text, high_text = found[1], found[2] if found[2] is not None else found[1]
        low, high = int(low_text), int(high_text)
        if low > high:
            raise UsageError(f"{what}: the range {part} runs high to low")
        out.append((low, high, len(low_text)))
    return out


def _item_parts(item: str, what: str) -> list[str | list[tuple[int, int, int]]]:
    """An item as its fixed text and its brackets' ranges, alternately."""
    parts: list[str | list[tuple[int, int, int]]] = []
    rest = item
    while rest:
        head, sep, tail = rest.partition("[")
        if _NAME.fullmatch(head) is None:
            raise UsageError(f"{what}: {head!r} is not a host name (A-Z a-z 0-9 . _ -)")
        parts.append(head)
        if not sep:
            break
        body, _, rest = tail.partition("]")
        parts.append(_ranges(body, what))
    return parts


def expand_hostlist(text: str, *, name: str = "SLURM_JOB_NODELIST") -> tuple[str, ...]:
    """The hosts of a SLURM host list, in the order written (see the module docstring).

    Args:
        text: the list, e.g. ``"gpu[001-004,007],login1"``.
        name: the variable it came from, named in every error.

    Raises:
        UsageError: a malformed list, a host named twice, or more than MAX_HOSTS hosts.
    """
    what = f"{name}={_shown(text)}"
    if not isinstance(text, str) or not text:
        raise UsageError(f"{name} is empty: expected SLURM's host list, e.g. node[01-04]")
    if len(text) > _MAX_TEXT:
        raise UsageError(f"{what}: longer than {_MAX_TEXT:,} characters")
    items = []
    total = 0
    for item in _split_top(text, what):
        if not item:
            raise UsageError(f"{what}: an empty host between commas")
        parts = _item_parts(item, what)
        count = 1
        for part in parts:
            if isinstance(part, list):
                count *= sum(high - low + 1 for low, high, _ in part)
                if count > MAX_HOSTS:
                    break
        total += count
        if total > MAX_HOSTS:
            raise UsageError(f"{what}: more than {MAX_HOSTS:,} hosts")
        items.append(parts)
    hosts: list[str] = []
    for parts in items:
        names = [""]
        for part in parts:
            if isinstance(part, str):
                names = [n + part for n in names]
            else:
                numbers = [
                    f"{n:0{width}d}" for low, high, width in part for n in range(low, high + 1)
                ]
                names = [n + number for n in names for number in numbers]
        hosts.extend(names)
    seen: set[str] = set()
    for host in hosts:
        if host in seen:
            raise UsageError(f"{what}: names host {host} twice")
        seen.add(host)
    return tuple(hosts)
