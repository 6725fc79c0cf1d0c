"""The names of checkpoints: who saved them (host, job, rank), what kind, at which step.

A checkpoint is a directory ``checkpoint_{host}_{job}_{kind}_step{step}`` (the article's
``checkpoint_{hostname}_{slurm_job_id}``, with the kind and the zero-padded step) holding one
file per rank, ``checkpoint_{host}_{job}_{kind}_step{step}_rank{rank}.pt.zst``, and its
``manifest.json``. The job is ``SLURM_JOB_ID``, so a job restarted under a new id never
writes over the checkpoints of the one before it; ranks never share a file. While it is
written the directory has a hidden temp name (``.checkpoint_...`` with shardio's temp mark
and a token the ranks agree on); the rename to its final name is what makes it visible.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import socket
from collections.abc import Mapping

from shardio._check import require_int
from shardio._env import shown_value
from shardio.errors import UsageError
from shardio.storage.atomic import TEMP_MARK

__all__ = [
    "KINDS",
    "MANIFEST_NAME",
    "MAX_STEP",
    "Identity",
    "check_kind",
    "check_step",
    "clean_host",
    "dir_name",
    "fragment_name",
    "is_checkpoint_name",
    "is_job_id",
    "is_rank_file_name",
    "is_temp_dir_name",
    "job_id_from",
    "new_token",
    "rank_file_name",
    "step_of_name",
    "temp_dir_name",
    "this_host",
]

KINDS = ("full", "light")
MANIFEST_NAME = "manifest.json"
MAX_STEP = 10**15 - 1  # 15 digits: far beyond any training run's steps
NO_JOB = "nojob"  # outside SLURM

_HOST_BAD = re.compile(r"[^A-Za-z0-9.-]+")
_JOB = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,63}")
_TOKEN = re.compile(r"[0-9a-f]{16}")
_DIR = re.compile(
    r"checkpoint_[A-Za-z0-9.-]{1,63}_[A-Za-z0-9.-]{1,64}_(full|light)_step[0-9]{15}(-[0-9]{1,3})?"
)
_FILE = re.compile(
    r"checkpoint_[A-Za-z0-9.-]{1,63}_[A-Za-z0-9.-]{1,64}_(full|light)_step[0-9]{15}"
    r"_rank[0-9]{5,9}\.pt(\.zst)?"
)


def clean_host(name: str) -> str:
    """A host name as names carry it: letters, digits, ``.`` and ``-`` (``_`` separates the
    parts of a name), at most 63 characters; ``host`` when nothing is left."""
    cleaned = _HOST_BAD.sub("-", name).strip(".-")[:63].strip(".-")
    return cleaned or "host"


def this_host() -> str:
    """This machine's short host name, cleaned (:func:`clean_host`)."""
    return clean_host(socket.gethostname().split(".", 1)[0])


def job_id_from(environ: Mapping[str, str]) -> str:
    """The job's id from ``SLURM_JOB_ID`` (``nojob`` outside SLURM).

    Raises:
        UsageError: ``SLURM_JOB_ID`` is set to something that is not a job id (it would
            become part of a file name).
    """
    value = environ.get("SLURM_JOB_ID")
    if value is None:
        return NO_JOB
    if _JOB.fullmatch(value) is None:
        raise UsageError(
            f"SLURM_JOB_ID={shown_value(value)} is not a job id: expected 1-64 letters, "
            "digits, '.' or '-'"
        )
    return value


def check_kind(kind: object) -> str:
    """``kind`` when it is ``full`` or ``light``; else a UsageError."""
    if not isinstance(kind, str) or kind not in KINDS:
        raise UsageError(f"checkpoint kind must be 'full' or 'light', not {kind!r}")
    return kind


def check_step(step: object) -> int:
    """``step`` as an int when it is a whole number 0..MAX_STEP; else a UsageError."""
    return require_int(step, "checkpoint step", minimum=0, maximum=MAX_STEP)


def new_token() -> str:
    """A fresh token naming one save's temp directory (16 hex digits)."""
    return secrets.token_hex(8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Identity:
    """Who saves: this rank, the job's ranks, their hosts, the job's id.

    Attributes:
        rank: this process's rank (0 outside torch.distributed).
        world_size: the number of ranks.
        hosts: every rank's host name, cleaned, by rank.
        job_id: the job's id (``SLURM_JOB_ID`` of rank 0, or ``nojob``).
    """

    rank: int
    world_size: int
    hosts: tuple[str, ...]
    job_id: str

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size or len(self.hosts) != self.world_size:
            raise UsageError(
                f"rank {self.rank} of {self.world_size} with {len(self.hosts)} host names"
            )
        if _JOB.fullmatch(self.job_id) is None:
            raise UsageError(f"job id {shown_value(self.job_id)} is not a job id")

    @property
    def host(self) -> str:
        """This rank's host."""
        return self.hosts[self.rank]


def dir_name(identity: Identity, kind: str, step: int, attempt: int = 0) -> str:
    """The final name of a checkpoint directory (rank 0's host); ``-N`` for the Nth name
    tried when the plain one is taken (a job that saves the same step again)."""
    base = f"checkpoint_{identity.hosts[0]}_{identity.job_id}_{kind}_step{step:015d}"
    return base if attempt == 0 else f"{base}-{attempt + 1}"


def rank_file_name(host: str, job_id: str, kind: str, step: int, rank: int, *, zstd: bool) -> str:
    """The file of one rank's state: its host, the job, the kind, the step and the rank."""
    name = f"checkpoint_{host}_{job_id}_{kind}_step{step:015d}_rank{rank:05d}.pt"
    return f"{name}.zst" if zstd else name


def temp_dir_name(identity: Identity, kind: str, step: int, token: str) -> str:
    """The hidden name a checkpoint directory has while its ranks write into it."""
    if _TOKEN.fullmatch(token) is None:
        raise UsageError(f"save token {shown_value(token)} is not 16 hex digits")
    return f".checkpoint_{identity.job_id}_{kind}_step{step:015d}{TEMP_MARK}{token}"


def fragment_name(rank: int) -> str:
    """The record a rank other than 0 leaves in the temp directory once its file is written
    (``.failed`` instead when its save failed): what rank 0 waits for before committing."""
    return f"rank{rank:05d}.json"


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is the final name of a checkpoint directory."""
    return _DIR.fullmatch(name) is not None


def is_job_id(text: str) -> bool:
    """Whether ``text`` can be a job id in a name."""
    return _JOB.fullmatch(text) is not None


def step_of_name(name: str) -> int:
    """The step in a checkpoint directory's name (0 when it has none)."""
    found = re.search(r"_step([0-9]{15})(?:-[0-9]+)?$", name)
    return int(found.group(1)) if found else 0


def is_rank_file_name(name: str) -> bool:
    """Whether ``name`` is the name of a rank's checkpoint file."""
    return _FILE.fullmatch(name) is not None


def is_temp_dir_name(name: str) -> bool:
    """Whether ``name`` is the temp name of a checkpoint directory being written (or
    being removed)."""
    return name.startswith(".checkpoint_") and TEMP_MARK in name
