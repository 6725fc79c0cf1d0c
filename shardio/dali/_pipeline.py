"""ShardPipeline: a built DALI pipeline over a shardio dataset, with its order and rank split.

Two paths. Verified (the default, and every HDF5 dataset): shardio's own reader feeds an
``external_source`` and checks each member's xxh3-64 first, in ShardDataset's order. Unverified
(tar with ``verify=False``): DALI's ``fn.readers.webdataset`` reads the shards and their
``.idx`` files itself, and nothing checks the bytes.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from shardio._check import require_int, require_path
from shardio._deprecated import renamed_option
from shardio.errors import ShardioError, UsageError
from shardio.format.manifest import Manifest
from shardio.metrics.read import ReadMetrics
from shardio.order.cursor import EpochCursor
from shardio.order.ranks import RankInfo, detect_ranks, given_ranks
from shardio.order.spec import OrderSpec, resolve_spec
from shardio.read.reader import ShardReader
from shardio.read.setup import set_up_reader
from shardio.topology.place import local_gpu
from shardio.topology.sysfs import SYSFS_ENV, read_topology

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from shardio.dali._source import VerifiedSource

__all__ = ["DALIOptions", "ShardPipeline", "UnverifiedReadWarning"]

DECODERS = (None, "cpu", "mixed")


class UnverifiedReadWarning(UserWarning):
    """The pipeline hands DALI bytes that shardio did not check (``verify=False``)."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _local_device(local: int) -> int | None:
    """``device_id="auto"``: the GPU of local rank ``local`` (modulo the GPUs this process
    sees, after ``CUDA_VISIBLE_DEVICES``; read from sysfs, ``SHARDIO_SYSFS`` for another
    tree), None (a CPU-only pipeline) when it sees none."""
    sysfs = os.environ.get(SYSFS_ENV) or "/sys"
    try:
        topology = read_topology(sysfs)
        if topology.gpus and not os.path.isdir(os.path.join(sysfs, "module", "nvidia")):
            logger.info("device_id='auto': GPUs but no NVIDIA driver loaded; CPU-only")
            return None
        return local_gpu(topology, local)
    except UsageError:
        raise  # a malformed rank variable: named, as ShardDataset does
    except (ShardioError, OSError) as exc:
        logger.info("device_id='auto': no GPU found (%s); a CPU-only pipeline", exc)
        return None


@dataclass(frozen=True, kw_only=True)
class DALIOptions:
    """How :func:`shardio.dali.pipeline` builds its pipeline (see there for each field)."""

    batch_size: int
    num_threads: int = 2
    device_id: int | str | None = "auto"
    shard_id: int | None = None
    num_shards: int | None = None
    seed: int | None = None
    shuffle: bool = True
    order: str | OrderSpec | None = None
    window_shards: int | None = None
    drop_last: bool | None = None
    decode: str | None = None
    crop: int | None = None
    verify: bool = True
    stage: str | None = None
    prefetch_queue_depth: int = 2
    exts: tuple[str, ...] = ("jpeg",)
    rank_layout: RankInfo | None = None  # ShardDataset's ``ranks``, given whole
    cache: InitVar[str | None] = None  # the old name of ``stage`` (warns; goes in 0.3)
    spec: OrderSpec = field(init=False)  # the order, from the fields above
    layout: RankInfo = field(init=False)  # the ranks and nodes, from the fields above

    def __post_init__(self, cache: str | None) -> None:
        stage = renamed_option("DALIOptions", "cache", cache, "stage", self.stage)
        object.__setattr__(self, "stage", None if stage is None else require_path(stage, "stage"))
        require_int(self.batch_size, "batch_size", minimum=1)
        require_int(self.num_threads, "num_threads", minimum=1, maximum=1024)  # CPU threads
        require_int(self.prefetch_queue_depth, "prefetch_queue_depth", minimum=1)
        object.__setattr__(self, "layout", self._layout())
        if self.device_id == "auto":
            object.__setattr__(self, "device_id", _local_device(self.layout.local_rank))
        elif self.device_id is not None:
            require_int(self.device_id, "device_id", minimum=0)
        # The order as ShardDataset's (map mode): a name, a spec string or an OrderSpec.
        spec = resolve_spec(
            "map", self.order, shuffle=self.shuffle, seed=self.seed,
            window_shards=self.window_shards, drop_last=self.drop_last,
        )  # fmt: skip
        object.__setattr__(self, "spec", spec)
        if spec.partitioned and not self.verify:
            raise UsageError(
                f"order partition={spec.partition!r} needs verify=True: DALI's own reader "
                "(verify=False) splits the ranks by range of its own"
            )
        if self.decode not in DECODERS:
            raise UsageError(f"invalid decode {self.decode!r}: choose None, 'cpu' or 'mixed'")
        if self.decode == "mixed" and self.device_id is None:
            raise UsageError(
                "decode='mixed' decodes with nvJPEG on a GPU: give device_id (a CUDA device), "
                "or use decode='cpu'"
            )
        if self.crop is not None:
            require_int(self.crop, "crop", minimum=1)
            if self.decode is None:
                raise UsageError("crop needs decoded images: give decode='cpu' or 'mixed'")
        if isinstance(self.exts, str) or not self.exts:
            raise UsageError("exts must be a non-empty tuple of extensions, e.g. ('jpeg',)")
        for ext in self.exts:
            if not isinstance(ext, str) or not ext or ext.startswith(".") or ";" in ext:
                raise UsageError(f"invalid extension {ext!r} in exts (write 'jpeg', not '.jpeg')")

    def _layout(self) -> RankInfo:
        """The rank and node layout, as ShardDataset's: ``rank_layout`` as given; else
        ``shard_id``/``num_shards`` in the environment's node layout (``LOCAL_WORLD_SIZE``
        or SLURM's tasks per node, so ``partition=node`` reads this node's share); else the
        detected one (torch.distributed, SLURM, RANK/WORLD_SIZE)."""
        if self.rank_layout is not None:
            if not isinstance(self.rank_layout, RankInfo):
                raise UsageError(
                    f"ranks must be a shardio.order.RankInfo (ShardDataset's), not "
                    f"{type(self.rank_layout).__name__}"
                )
            if self.shard_id is not None or self.num_shards is not None:
                raise UsageError("give ranks, or shard_id and num_shards, not both")
            return self.rank_layout
        if (self.shard_id is None) != (self.num_shards is None):
            raise UsageError("give shard_id and num_shards together (or neither: detected)")
        if self.shard_id is None or self.num_shards is None:
            return detect_ranks()
        return given_ranks(
            require_int(self.shard_id, "shard_id", minimum=0),
            require_int(self.num_shards, "num_shards", minimum=1),
        )

    def ranks(self) -> RankInfo:
        """The rank and node layout the pipeline reads with (:attr:`layout`)."""
        return self.layout

    def op_seed(self, rank: int, salt: int) -> int:
        """A seed in [0, 2**31) for a DALI operator, distinct per rank and use."""
        seed = self.spec.seed
        words = [seed & 0xFFFFFFFF, seed >> 32, rank, salt]
        return int(np.random.SeedSequence(words).generate_state(1)[0]) % 2**31


class ShardPipeline:
    """A built DALI pipeline over a shardio dataset (made by :func:`shardio.dali.pipeline`).

    Its outputs are ``(data, label)``: data is the payload bytes (uint8, one 1-D array per
    sample), or RGB uint8 HWC images when decoded; label is the class index (int64, -1 for
    an unlabelled dataset).

    Attributes:
        pipe: the built ``nvidia.dali.Pipeline`` (replaced by :meth:`rebuild`).
        verified: True when shardio checks every member before DALI sees it.
        ranks: the rank and node layout (``ranks``, ``shard_id``/``num_shards`` with the
            environment's ranks per node, or detected like ShardDataset's).
        reader_name: the DALI reader's name on the unverified path (for DALI's iterators),
            None on the verified path (its epochs end with ``StopIteration``).
        manifest: the dataset's manifest.
        dataset_id: the dataset's id (the xxh3-128 of its manifest's bytes: ShardLoader's
            over the same dataset), which a checkpoint of its position records.
    """

    def __init__(self, path: str | os.PathLike[str], options: DALIOptions) -> None:
        from shardio.dali import _graph  # imports nvidia.dali

        self._graph = _graph
        self.path = os.fspath(path)
        self.options = options
        self.ranks = options.layout
        tar = False
        self.verified = options.verify
        self.reader_name: str | None = None
        self._source: VerifiedSource | None = None
        self._epoch = 0
        if options.verify:
            self._source = self._start_source()
            self.manifest: Manifest = self._source.packed.manifest
            found = self._source.packed.resolver.dataset_id
            tar = self.manifest.shard_format == "tar"
        else:
            opened = set_up_reader(self.path).open(stage=options.stage)
            try:
                self.manifest = opened.manifest
                found = opened.resolver.dataset_id
                tar = self.manifest.shard_format == "tar"
                if tar:
                    self.reader_name = _graph.READER_NAME
                    self._paths = self._reader_paths(opened)
            finally:
                opened.close()
            if not tar:
                self._source = self._start_source()
        # The id ShardLoader records over the same dataset (its manifest's xxh3-128): a
        # checkpoint of this pipeline's position resumes no other dataset, nor a torch
        # loader over another one.
        self.dataset_id: str | None = found if isinstance(found, str) else None
        if not options.verify:
            warnings.warn(
                UnverifiedReadWarning(
                    f"{self.path}: verify=False: "
                    + (
                        "DALI's webdataset reader reads the tar shards itself"
                        if tar
                        else "the HDF5 members are read without their checksum check"
                    )
                    + "; no byte is checked against shardio's xxh3-64, so a damaged shard "
                    "reaches training unnoticed"
                ),
                stacklevel=3,
            )
        try:
            self.pipe: Any = self._build()
        except BaseException:
            self.close()
            raise

    def _start_source(self) -> VerifiedSource:
        from shardio.dali._source import VerifiedSource

        o = self.options
        return VerifiedSource(
            self.path,
            batch_size=o.batch_size,
            spec=o.spec,
            ranks=self.ranks,
            verify=o.verify,
            stage=o.stage,
            exts=o.exts,
        )

    def _reader_paths(self, opened: ShardReader) -> tuple[list[str], list[str]]:
        """Shard and .idx paths for DALI's reader: staged copies where verified, shuffled by
        shard when ``shuffle`` (the same on every rank), since DALI splits ranks by range.

        DALI opens the staged copies itself, without the readers' shared lock: an eviction
        while the job runs is not held off for them (open files stay readable on POSIX).
        """
        if not any(e in opened.index.exts for e in self.options.exts):
            raise UsageError(
                f"{self.path}: no member has extension {' or '.join(self.options.exts)}"
            )
        resolver = opened.resolver
        paths, index_paths = [], []
        for k, entry in enumerate(self.manifest.shards):
            loc = resolver.locate(k)
            assert entry.dali_index is not None  # tar shards always carry one
            staged_idx = (
                os.path.join(resolver.cache_root, entry.dali_index)
                if loc.staged and resolver.cache_root is not None
                else None
            )
            paths.append(loc.path)
            if staged_idx is not None and os.path.isfile(staged_idx):
                index_paths.append(staged_idx)
            else:
                index_paths.append(os.path.join(resolver.source_root, entry.dali_index))
        if self.options.shuffle:
            seed = self.options.spec.seed
            words = [seed & 0xFFFFFFFF, seed >> 32, 0xDA11]
            perm = np.random.default_rng(words).permutation(len(paths)).tolist()
            paths, index_paths = [paths[i] for i in perm], [index_paths[i] for i in perm]
        return paths, index_paths

    def _build(self) -> Any:
        o = self.options
        common: dict[str, Any] = {
            "batch_size": o.batch_size,
            "num_threads": o.num_threads,
            "device_id": o.device_id,
            "depth": o.prefetch_queue_depth,
            "seed": o.op_seed(self.ranks.rank, 1),
            "decode": o.decode,
            "crop": o.crop,
        }
        if self._source is not None:
            return self._graph.build_external(self._source, **common)
        paths, index_paths = self._paths
        return self._graph.build_reader(
            paths,
            index_paths,
            exts=o.exts,
            labelled=self.manifest.classes is not None,
            shard_id=self.ranks.rank,
            num_shards=self.ranks.world_size,
            shuffle=o.shuffle,
            **common,
        )

    # -- epochs and sizes ----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next pass reads."""
        return self._source.cursor.epoch if self._source is not None else self._epoch

    @property
    def cursor(self) -> EpochCursor | None:
        """The epoch and the position in it (verified path; None on DALI's reader path,
        whose order is DALI's). :class:`~shardio.dali.DALILoader` advances it as it hands
        batches to the training loop."""
        return self._source.cursor if self._source is not None else None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next pass (a pass starting at DALI's iteration 0).

        On the verified path the order is ShardDataset's for (spec, epoch). DALI's reader
        (unverified path) reshuffles by its own generator every pass: there the epoch is
        recorded only.

        Raises:
            UsageError: ``epoch`` is not an integer >= 0.
        """
        self._epoch = require_int(epoch, "epoch", minimum=0)
        if self._source is not None:
            self._source.cursor.set_epoch(self._epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch stands: global positions delivered (ShardDataset's state: either
        can resume from the other's).

        Raises:
            UsageError: on DALI's reader path (``verify=False``), which has no resumable order.
        """
        return self._cursor_for("state_dict").state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (also with another number of ranks): the next
        pass reads the rest of that epoch.

        Raises:
            UsageError: the state is malformed or of another order or dataset; or DALI's
                reader path.
        """
        self._cursor_for("load_state_dict").load(state)

    def _cursor_for(self, what: str) -> EpochCursor:
        if self._source is None:
            raise UsageError(
                f"{what}: DALI's own reader (verify=False) has no resumable order; read with "
                "verify=True for mid-epoch resume"
            )
        return self._source.cursor

    def rank_indices(self) -> np.ndarray[Any, Any]:
        """Sample indices this rank reads in the current epoch, in order (verified path).

        Raises:
            UsageError: on the unverified path, whose order is DALI's.
        """
        if self._source is None:
            raise UsageError("the order of DALI's reader (verify=False) is DALI's own")
        return self._source.rank_indices()

    @property
    def packed(self) -> Any:
        """The reader that feeds DALI (shardio's own: the verified path, and HDF5), or None
        when DALI's reader reads the shards itself."""
        return None if self._source is None else self._source.packed

    @property
    def drop_last(self) -> bool:
        """Each rank cuts its remainder (True) or pads to equal counts (False)."""
        return self.options.spec.drop_last

    def samples_per_rank(self) -> int:
        """Samples every rank delivers per epoch (the same on each rank).

        Verified path: ShardDataset's count (``ceil(N / world)``, padded by repeating samples
        from the epoch's start, or ``N // world`` with ``drop_last``). Unverified path: whole
        batches of DALI's reader (its last batch padded by repeating the shard's last sample,
        or dropped with ``drop_last``).
        """
        b, world, n = self.options.batch_size, self.ranks.world_size, self.manifest.num_samples
        if self._source is not None:
            return self._source.samples_per_rank()
        if self.options.spec.drop_last:
            return n // world // b * b
        return _ceil_div(_ceil_div(n, world), b) * b

    def __len__(self) -> int:
        """Batches per epoch on each rank."""
        return _ceil_div(self.samples_per_rank(), self.options.batch_size)

    def iterator_kwargs(self) -> dict[str, Any]:
        """Arguments for DALI's framework iterators that end epochs where shardio does."""
        if self.reader_name is None:
            return {"size": -1}
        from nvidia.dali.plugin.base_iterator import LastBatchPolicy

        policy = LastBatchPolicy.DROP if self.options.spec.drop_last else LastBatchPolicy.FILL
        return {"reader_name": self.reader_name, "last_batch_policy": policy}

    def read_metrics(self) -> ReadMetrics:
        """The read figures of shardio's reader (verified path: latency by source, bytes,
        cache hits, checksum failures); empty on DALI's reader path, which reads alone."""
        return self._source.packed.metrics.copy() if self._source is not None else ReadMetrics()

    @property
    def uniform(self) -> bool:
        """Every batch's data has one shape (decoded and cropped): a dense tensor."""
        return self.options.crop is not None

    def rebuild(self) -> None:
        """Build a fresh DALI pipeline (a pass abandoned mid-epoch cannot be reset)."""
        self.pipe = None
        self.pipe = self._build()

    def close(self) -> None:
        """Drop the DALI pipeline and close the dataset's files."""
        self.pipe = None
        if self._source is not None:
            self._source.close()

    def __enter__(self) -> ShardPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
