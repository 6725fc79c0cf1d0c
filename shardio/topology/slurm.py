"""SLURM's CPU binding of a task, as srun's task environment gives it (``SLURM_CPU_BIND*``)."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from shardio._env import shown_value
from shardio.topology.cpulist import MAX_CPU
from shardio.topology.model import SlurmBinding

__all__ = ["slurm_binding"]

log = logging.getLogger(__name__)

_HEX_MASK = re.compile(rf"(?:0[xX])?([0-9a-fA-F]{{1,{MAX_CPU // 4}}})")


def _bind_entry_cpus(kind: str, entry: str) -> frozenset[int] | None:
    """The CPUs of one ``SLURM_CPU_BIND_LIST`` entry of a ``mask_cpu``/``map_cpu`` binding."""
    if kind == "mask_cpu":
        match = _HEX_MASK.fullmatch(entry)
        if match is None:
            return None
        mask = int(match.group(1), 16)
        return frozenset(i for i in range(mask.bit_length()) if mask >> i & 1) or None
    hexa = entry[:2].lower() == "0x"  # map_cpu: a CPU id, or 0x<hex>
    number = entry[2:] if hexa else entry
    if not re.fullmatch(r"[0-9a-fA-F]{1,5}" if hexa else r"[0-9]{1,6}", number):
        return None
    cpu = int(number, 16 if hexa else 10)
    return frozenset({cpu}) if cpu < MAX_CPU else None


def _bind_kind(cpu_bind: str | None, cpu_bind_type: str | None) -> tuple[str | None, str | None]:
    """("mask_cpu" | "map_cpu" | None, the list inlined in SLURM_CPU_BIND) of a binding.

    srun's task environment writes ``SLURM_CPU_BIND_TYPE`` as ``mask_cpu:``, ``map_cpu:``,
    ``none``, or with the level first (``ldoms,mask_cpu:``); ``--cpu-bind=cores|threads|
    sockets`` arrives as ``mask_cpu:`` with one hex mask per task of the node (slurmd turns
    the level into masks). ``SLURM_CPU_BIND`` is ``quiet,mask_cpu:0x..,0x..`` (or
    ``verbose,...``, ``quiet,none``).
    """
    for token in (cpu_bind_type or "").split(","):
        if token.strip() in ("mask_cpu:", "mask_cpu"):
            return "mask_cpu", None
        if token.strip() in ("map_cpu:", "map_cpu"):
            return "map_cpu", None
    for kind in ("mask_cpu", "map_cpu"):
        head, sep, tail = (cpu_bind or "").partition(f"{kind}:")
        if sep and (not head or head.endswith(",")):
            return kind, tail
    return None, None


def slurm_binding(env: Mapping[str, str], local: int | None) -> SlurmBinding:
    """SLURM's CPU binding of local task ``local`` from ``SLURM_CPU_BIND*`` (see
    :func:`_bind_kind` for the forms); one not understood is kept as text only."""
    bind = env.get("SLURM_CPU_BIND") or None
    kind_text = env.get("SLURM_CPU_BIND_TYPE") or None
    listed = env.get("SLURM_CPU_BIND_LIST") or None
    if bind is None and kind_text is None and listed is None:
        return SlurmBinding()
    kind, inline = _bind_kind(bind, kind_text)
    text = (listed if listed is not None else inline) or ""
    entries = [e.strip() for e in text.split(",")] if kind and text else []
    per_entry = [_bind_entry_cpus(kind, e) for e in entries] if kind else []
    if not per_entry or any(c is None for c in per_entry):
        if per_entry:
            log.debug("SLURM_CPU_BIND_LIST=%s not understood: binding ignored", shown_value(text))
        return SlurmBinding(cpu_bind=bind, cpu_bind_type=kind_text, cpu_bind_list=listed)
    sets = [c for c in per_entry if c is not None]
    cpus = sets[local % len(sets)] if local is not None else None
    return SlurmBinding(
        cpu_bind=bind,
        cpu_bind_type=kind_text,
        cpu_bind_list=listed,
        task_cpus=cpus,
        step_cpus=frozenset().union(*sets),
        per_task=len(set(sets)) > 1,
    )
