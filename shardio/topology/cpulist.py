"""Kernel cpulists (``"0-15,32-47"``): parsing, strictly and bounded, and writing."""

from __future__ import annotations

import re
from collections.abc import Iterable

from shardio._env import shown_value
from shardio.errors import FormatError

__all__ = ["CPU_NUMBER", "MAX_CPU", "format_cpulist", "parse_cpulist"]

MAX_CPU = 1 << 16  # far beyond any kernel's NR_CPUS: a larger number is a typo
CPU_NUMBER = re.compile(r"[0-9]{1,6}")  # ASCII only: str.isdigit() also takes "²" and "٣"


def parse_cpulist(text: str, *, what: str = "CPU list") -> frozenset[int]:
    """The CPUs of a kernel cpulist such as ``"0-15,32-47"`` (empty text: no CPU).

    Raises:
        FormatError: ``text`` is not a cpulist; the message names ``what``.
    """
    stripped = text.strip()
    cpus: set[int] = set()
    if not stripped:
        return frozenset()
    for part in (p.strip() for p in stripped.split(",")):
        first, dash, last = part.partition("-")
        if not CPU_NUMBER.fullmatch(first) or (dash and not CPU_NUMBER.fullmatch(last)):
            raise FormatError(
                f"malformed {what} {shown_value(stripped)}: {shown_value(part)} is not N or N-M"
            )
        low, high = int(first), int(last) if dash else int(first)
        if low > high or high >= MAX_CPU:
            raise FormatError(
                f"malformed {what} {shown_value(stripped)}: bad range {shown_value(part)}"
            )
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 3, 8}`` as the kernel writes it: ``"0-3,8"``."""
    ranges: list[str] = []
    run: list[int] = []
    for cpu in sorted(cpus):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            ranges.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [cpu]
    if run:
        ranges.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(ranges)
