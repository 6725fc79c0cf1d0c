"""Pack a tree of small files into a dataset: lock DST, recognise what it holds, then pack,
resume, check or replace.

The manifest is written last and atomically; every shard, DALI index and per-shard index
fragment appears under its final name only when complete. A per-shard done-record in the
work directory marks a shard done, so a killed pack resumes with ``resume=True`` and reuses
the shards whose checksums still match. ``force=True`` packs the new dataset beside the old
one and swaps them only once it is complete (:mod:`shardio.packing.replace`). A multi-node
pack runs one part per SLURM task (``part``/``num_parts``) and
:func:`shardio.packing.merge.merge_parts` joins them.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import time

from shardio.errors import FormatError, PackError, SourceError, UsageError
from shardio.format.label_source import LabelSource
from shardio.format.manifest import Manifest, load_manifest
from shardio.format.spec import MANIFEST_FILENAME, WORK_DIR
from shardio.metrics.progress import ProgressCallback
from shardio.packing.dest import (
    DestState,
    check_owned,
    dataset_files,
    existing_dir,
    inspect_dst,
    layout_of,
    make_dst,
    remove_bare_dst,
    remove_interrupted,
    remove_temps,
    remove_work_dir,
)
from shardio.packing.merge import MergeResult
from shardio.packing.options import PackOptions, PackResult
from shardio.packing.part import RunContext, alignment_for, fingerprint_of, pack_part, scan_part
from shardio.packing.replace import commit_replacement, finish_commit, next_dir
from shardio.packing.workfiles import NEXT_DIR
from shardio.storage.dirlock import lock_directory
from shardio.storage.files import make_dirs_inside
from shardio.storage.runner import CommandRunner, run_command

__all__ = ["PackOptions", "PackResult", "pack"]


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def _check_paths(src: str, dst: str) -> None:
    real_src = os.path.realpath(src)
    real_dst = os.path.realpath(dst)
    if not os.path.exists(src):
        raise SourceError(errno.ENOENT, f"source {src} does not exist")
    if not os.path.isdir(src):
        raise SourceError(errno.ENOTDIR, f"source {src} is not a directory")
    if _inside(real_dst, real_src):
        raise UsageError(f"destination {dst} is inside the source {src}: choose a path outside it")
    if _inside(real_src, real_dst):
        raise UsageError(f"source {src} is inside the destination {dst}: choose another path")


def pack(
    src: str,
    dst: str,
    options: PackOptions,
    *,
    progress: ProgressCallback | None = None,
    runner: CommandRunner = run_command,
) -> PackResult:
    """Pack the tree at ``src`` into a shardio dataset at ``dst``.

    DST must be new, empty, an interrupted pack (with ``resume`` or ``force``) or a shardio
    dataset (with ``force``, or ``resume`` to check it is up to date). A lock on DST keeps
    two packs from writing there at once.

    Raises:
        SourceError: the source is missing, empty or unreadable.
        UsageError: bad options or destination (foreign files, inside the source, locked).
        PackError: strict mode met an unpackable file, the source or options changed under
            --resume, or a worker process died.
        FormatError: a work file of an interrupted pack is damaged (naming it).
        StorageError: writing failed (ENOSPC included); published shards stay for --resume.
    """
    ctx = RunContext(progress, runner, time.monotonic())
    _check_paths(src, dst)
    if options.parity:  # the extra and the scheme, before anything is written
        from shardio.parity.codec import parse_scheme
        from shardio.parity.dataset import codec_for

        codec_for(*parse_scheme(options.parity), 4096)
    created = make_dst(dst)
    with lock_directory(dst, shared=options.num_parts > 1):
        try:
            return _pack_locked(src, dst, options, ctx)
        except BaseException:
            if created:
                remove_bare_dst(dst)
            raise


def _pack_locked(src: str, dst: str, options: PackOptions, ctx: RunContext) -> PackResult:
    """Decide from what DST holds, then pack, resume, check or replace (DST is locked)."""
    state = inspect_dst(dst)
    committed = False
    if state.commit is not None:
        if not (options.force or options.resume) or options.num_parts > 1:
            raise UsageError(
                f"{dst} holds a replacement interrupted half-way (a killed --force): rerun "
                "with --force or --resume (without --part) to finish it"
            )
        finish_commit(dst, state.commit, durable=options.durable)
        state, committed = inspect_dst(dst), True
    if state.kind == "foreign":
        raise UsageError(_foreign_message(dst, state, options))
    manifest = state.manifest
    if state.kind == "dataset" and manifest is not None:
        if options.resume and state.has_next:
            return _replace(src, dst, options, manifest, ctx)
        if options.resume or (options.force and committed):
            try:
                result = _finished(src, dst, options, manifest, ctx)
            except PackError:
                if options.resume:
                    raise
            else:  # up to date; maybe just finished a replacement a killed --force began
                if committed:
                    note = f"finished replacing the dataset in {dst} (a killed --force began it)"
                    result = dataclasses.replace(result, warnings=(note,), replaced=True)
                return result
        if options.force:
            return _replace(src, dst, options, manifest, ctx)
        raise UsageError(f"{dst} already holds a shardio dataset: use --force to overwrite it")
    if state.kind == "interrupted":
        _check_interrupted(dst, state, options)
        if options.force:
            remove_interrupted(dst, state.states)
    return pack_part(src, dst, options, ctx)


def _foreign_message(dst: str, state: DestState, options: PackOptions) -> str:
    if options.force:
        return (
            f"{state.why}: shardio only replaces a dataset it wrote (a manifest.json whose "
            "index.bin matches), and will not remove anything here; choose an empty or new "
            "directory"
        )
    if options.resume:
        return (
            f"{state.why}: it is neither an interrupted shardio pack nor a shardio dataset, "
            "so there is nothing to resume; choose an empty or new directory"
        )
    return (
        f"{state.why} and holds neither a shardio dataset (for --force) nor an interrupted "
        "pack (for --resume): choose an empty or new directory"
    )


def _check_interrupted(dst: str, state: DestState, options: PackOptions) -> None:
    if state.damaged:
        raise FormatError(
            f"{state.damaged}: shardio cannot tell which files the interrupted pack in {dst} "
            "wrote; remove them by hand and pack again"
        )
    if options.force:
        return
    splits = {s.num_parts for s in state.states}
    if splits != {options.num_parts}:
        n = max(splits)
        how = f"--part I/{n} --resume" if n > 1 else "--resume (without --part)"
        raise UsageError(
            f"{dst} holds an interrupted pack split into {n} part(s): finish it with {how}, "
            "or start over with --force"
        )
    if options.resume:
        return
    if options.num_parts > 1 and all(s.part != options.part for s in state.states):
        return  # another part of the same pack started first
    raise UsageError(
        f"{dst} holds an interrupted pack: use --resume to finish it, or --force to start over"
    )


# --------------------------------------------------------------------------- finished


def _finished(
    src: str, dst: str, options: PackOptions, manifest: Manifest, ctx: RunContext
) -> PackResult:
    """--resume of a finished dataset: check it was packed from this tree with these options,
    then tidy what a kill after the manifest left."""
    fingerprints = manifest.pack_fingerprints
    if not fingerprints:
        raise PackError(
            f"{dst} was packed by a shardio that did not record what it packed, so --resume "
            f"cannot check it against {src}: use --force to pack it again"
        )
    layout = layout_of(manifest)
    plan = scan_part(src, options)
    fingerprint = fingerprint_of(plan, options, alignment_for(layout, options))
    same_map = (manifest.classes, _origin(manifest.label_source)) == (
        plan.listing.classes,
        _origin(plan.listing.label_source),
    )
    if (
        len(fingerprints) != options.num_parts
        or fingerprints[options.part] != fingerprint
        or not same_map
    ):
        raise PackError(
            f"the source or the options changed since {dst} was packed: rerun with the same "
            "options, or with --force to pack it again"
        )
    leftovers = existing_dir(os.path.join(dst, WORK_DIR))
    remove_work_dir(dst)
    remove_temps(dst)
    done = "nothing was packed or rewritten" + (
        " (removed the work files a kill after the manifest left)" if leftovers else ""
    )
    files = manifest.num_members - (manifest.num_samples if manifest.classes is not None else 0)
    result = PackResult(
        dst=dst,
        num_samples=manifest.num_samples,
        num_files=files,
        num_shards=len(manifest.shards),
        data_bytes=manifest.data_bytes,
        total_bytes=manifest.total_bytes,
        seconds=time.monotonic() - ctx.start,
        reused_shards=len(manifest.shards),
        skipped=(),
        oversized=(),
        layout=layout,
        part=options.part,
        num_parts=options.num_parts,
        warnings=(
            f"{dst} was already complete: nothing to resume (its recorded plan matches {src} "
            f"and these options; {done})",
        ),
        source_calls=plan.calls.copy(),
        already_complete=True,
    )
    return result.with_labels(plan.listing)


def _origin(source: LabelSource | None) -> tuple[str, str] | None:
    return source.identity if source is not None else None


# --------------------------------------------------------------------------- replace


def _replace(
    src: str, dst: str, options: PackOptions, old: Manifest, ctx: RunContext
) -> PackResult:
    """Pack the new dataset into DST/.shardio-work/next/, then swap it in (journaled).

    With ``options.resume`` an interrupted replacement pack is resumed instead.
    """
    check_owned(dst, dataset_files(old), source=os.path.join(dst, MANIFEST_FILENAME))
    nxt = next_dir(dst)
    if not options.resume and existing_dir(nxt):
        shutil.rmtree(nxt)  # a replacement a killed --force began: this --force starts over
    make_dirs_inside(dst, f"{WORK_DIR}/{NEXT_DIR}")
    inner = dataclasses.replace(options, force=False)
    result = _pack_locked(src, nxt, inner, ctx)
    new = load_manifest(os.path.join(nxt, MANIFEST_FILENAME))
    commit_replacement(dst, old, new, durable=options.durable)
    calls = result.merged.part_calls if result.merged is not None else (result.source_calls,)
    merged = MergeResult(manifest=new, num_parts=1, part_calls=calls)
    return dataclasses.replace(result, dst=dst, merged=merged, warnings=(), replaced=True)
