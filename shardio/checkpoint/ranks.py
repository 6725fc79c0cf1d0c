"""Who the ranks are and how they agree: torch.distributed when it is initialized, else one.

Only the calling thread talks to the process group, and only where every rank calls the
same function at the same point of training (a save, a load, a cadence check): the writing
itself, in the background, meets through the filesystem (``store``), never a collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardio.checkpoint.naming import Identity, job_id_from, new_token, this_host
from shardio.errors import UsageError

__all__ = [
    "agree",
    "check_environ",
    "gather",
    "new_shared_token",
    "rank_and_world",
    "resolve_identity",
    "said",
    "share_from_zero",
    "side_group",
]


def _dist() -> Any | None:
    """``torch.distributed`` when a process group is initialized, else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # a torch without distributed support
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def rank_and_world(group: Any = None) -> tuple[int, int]:
    """This process's rank and the number of ranks (0 and 1 without a process group)."""
    dist = _dist()
    if dist is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def gather(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value``, by rank (``[value]`` alone)."""
    dist = _dist()
    if dist is None or dist.get_world_size(group) == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def share_from_zero(value: Any, group: Any = None) -> Any:
    """Rank 0's ``value`` on every rank."""
    dist = _dist()
    if dist is None or dist.get_world_size(group) == 1:
        return value
    box = [value]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def agree(ok: bool, reason: str, group: Any = None) -> list[str]:
    """Every rank says whether it is fine; the reasons of those that are not, by rank."""
    said = gather((ok, reason), group)
    return [f"rank {r}: {why}" for r, (fine, why) in enumerate(said) if not fine]


def said(failure: BaseException | None) -> str | None:
    """What a rank tells the others of its failure: one line, or None."""
    if failure is None:
        return None
    text = str(failure).strip().splitlines()
    return (text[0] if text else type(failure).__name__)[:1000]


def resolve_identity(environ: Mapping[str, str], group: Any = None) -> Identity:
    """This rank's identity: rank, world, every rank's host, rank 0's job id.

    Raises:
        UsageError: ``environ`` is not a mapping of str to str, or ``SLURM_JOB_ID`` is
            malformed.
    """
    rank, world = rank_and_world(group)
    if world == 1:
        check_environ(environ)
        _refuse_ranks_without_a_group(environ)
    try:
        check_environ(environ)
        mine: tuple[str, str | None, str | None] = (this_host(), job_id_from(environ), None)
    except ValueError as exc:  # every rank must reach the gather, then all raise
        mine = (this_host(), None, str(exc))
    everyone = gather(mine, group)
    failed = [(r, e) for r, (_, _, e) in enumerate(everyone) if e is not None]
    if failed:
        raise UsageError(f"rank {failed[0][0]}: {failed[0][1]}")
    job = everyone[0][1]
    return Identity(
        rank=rank, world_size=world, hosts=tuple(h for h, _, _ in everyone), job_id=job or ""
    )


def check_environ(environ: object) -> Mapping[str, str]:
    """``environ`` when it maps str to str, as ``os.environ`` does.

    Raises:
        UsageError: it does not; the message names the first wrong entry.
    """
    if not isinstance(environ, Mapping):
        raise UsageError(
            f"environ must be a mapping of str to str (like os.environ), not "
            f"{type(environ).__name__}"
        )
    for key, value in environ.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise UsageError(
                f"environ must map str to str (like os.environ): environ[{key!r}] is "
                f"{type(value).__name__} {value!r}"[:300]
            )
    return environ


def side_group() -> Any:
    """A gloo group of every rank, for the small agreements of checkpointing, kept apart
    from the training's own group (None without a process group of more than one rank).
    Every rank must call it, at the same point."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo")


def _refuse_ranks_without_a_group(environ: Mapping[str, str]) -> None:
    """Refuse to save as a lone process when the environment says this is one rank of many:
    each would commit a checkpoint of its own, and a restart could load another rank's."""
    from shardio.order.ranks import detect_ranks

    found = detect_ranks(environ)
    if found.world_size > 1:
        raise UsageError(
            f"{found.source} says this is rank {found.rank} of {found.world_size}, but "
            "torch.distributed is not initialized: initialize it before saving "
            "checkpoints, so the ranks save one checkpoint together"
        )


def new_shared_token(group: Any = None) -> str:
    """A token for one save, the same on every rank."""
    return str(share_from_zero(new_token(), group))
