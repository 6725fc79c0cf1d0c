"""Apply the stripe layout of a destination directory before any shard is written.

On Lustre a directory's default layout (``lfs setstripe`` on the directory) is inherited by
every file created in it afterwards, and a file's layout cannot change once written; on BeeGFS
the stripe pattern (``beegfs-ctl --setpattern``) works the same way. So the layout is set on
the destination directory first, and the shards written into it pick it up. Files already in
the directory keep the layout they were created with.

On any other filesystem this is a logged no-op. A missing or failing ``lfs``/``beegfs-ctl`` is
not fatal: shards are then written with the filesystem's default layout, and the outcome is
recorded in a :class:`LayoutResult` for the manifest.
"""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from shardio.errors import CommandNotFoundError, FormatError, StorageError, UsageError
from shardio.storage.fsdetect import NETWORK_FS, PARALLEL_FS
from shardio.storage.runner import CommandResult, CommandRunner, run_command
from shardio.storage.stripe_spec import (
    DEFAULT_PFL,
    SMALL_STRIPE_BYTES,
    StripeSpec,
    beegfs_size,
    lfs_size,
    parse_stripe,
    plan_stripe,
)

__all__ = [
    "LayoutResult",
    "apply_layout",
    "describe_layout",
    "lustre_ost_count",
]

logger = logging.getLogger(__name__)

LAYOUT_ACTIONS: Final = frozenset({"applied", "skipped", "failed", "none"})

# Progressive File Layout: 1 stripe of 1 MiB up to 64 MiB, 4 stripes up to 1 GiB, then the
# spec's count and size (8 x 4 MiB by default) to end of file; counts capped by the OST count.
_PFL_FIRST_END: Final = "64M"
_PFL_SECOND_END: Final = "1G"
_PFL_SECOND_COUNT: Final = 4


def lustre_ost_count(path: str | os.PathLike[str], runner: CommandRunner) -> int | None:
    """Count the active OSTs of the Lustre filesystem holding ``path`` with ``lfs df``.

    Args:
        path: a path on Lustre.
        runner: runs ``lfs df PATH``.

    Returns:
        The number of OST lines (UUID ending in ``_UUID``, mount column ``[OST:n]``), or
        ``None`` with a logged warning when ``lfs`` is missing, fails or lists no OST.
    """
    argv = ("lfs", "df", os.fspath(path))
    try:
        result = runner(argv)
    except StorageError as exc:
        # A missing lfs is reported once, by the setstripe that follows.
        logger.info("cannot count OSTs for %s: %s; planning without it", path, exc)
        return None
    if not result.ok:
        logger.warning(
            "cannot count OSTs for %s: %s; planning without it", path, _failure_text(result)
        )
        return None
    count = 0
    for line in result.stdout.splitlines():
        fields = line.split()
        if fields and "_UUID" in fields[0] and "[OST:" in line:
            count += 1
    if count == 0:
        logger.warning("cannot count OSTs for %s: lfs df listed no OST; planning without it", path)
        return None
    return count


@dataclass(frozen=True, kw_only=True)
class LayoutResult:
    """What :func:`apply_layout` did to a destination directory, for logs and the manifest.

    Attributes:
        fs_type: the filesystem type the layout was planned for.
        action: ``applied`` (layout set), ``skipped`` (filesystem without striping),
            ``failed`` (the tool was missing or failed; default layout used) or ``none``
            (striping turned off by the user).
        stripe: the layout as text (``4x4MiB``, ``pfl``), or ``None`` when none was planned.
        commands: the layout commands run, or attempted when ``action`` is ``failed``;
            queries such as ``lfs df`` are not listed.
        message: one line for people.
    """

    fs_type: str
    action: str
    stripe: str | None
    commands: tuple[tuple[str, ...], ...]
    message: str

    def __post_init__(self) -> None:
        if self.action not in LAYOUT_ACTIONS:
            allowed = ", ".join(sorted(LAYOUT_ACTIONS))
            raise UsageError(f"invalid layout action {self.action!r}: choose one of {allowed}")
        object.__setattr__(self, "commands", tuple(tuple(argv) for argv in self.commands))

    def to_json(self) -> dict[str, Any]:
        """Return the result as a JSON-ready dict with snake_case keys."""
        return {
            "fs_type": self.fs_type,
            "action": self.action,
            "stripe": self.stripe,
            "commands": [list(argv) for argv in self.commands],
            "message": self.message,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LayoutResult:
        """Rebuild a result from :meth:`to_json` output.

        Raises:
            FormatError: a key is missing or has the wrong type.
        """
        try:
            fs_type, action, stripe = data["fs_type"], data["action"], data["stripe"]
            message, commands = data["message"], data["commands"]
        except (KeyError, TypeError) as exc:
            raise FormatError(f"invalid layout record: missing key {exc}") from exc
        if not all(isinstance(v, str) for v in (fs_type, action, message)) or not (
            stripe is None or isinstance(stripe, str)
        ):
            raise FormatError("invalid layout record: fs_type, action, message must be strings")
        if not isinstance(commands, list) or not all(
            isinstance(argv, list) and all(isinstance(arg, str) for arg in argv)
            for argv in commands
        ):
            raise FormatError("invalid layout record: commands must be lists of strings")
        try:
            return cls(
                fs_type=fs_type,
                action=action,
                stripe=stripe,
                commands=tuple(tuple(argv) for argv in commands),
                message=message,
            )
        except UsageError as exc:
            raise FormatError(f"invalid layout record: {exc}") from exc


def _failure_text(result: CommandResult) -> str:
    detail = result.stderr.strip().splitlines() or result.stdout.strip().splitlines()
    suffix = f": {detail[-1].strip()}" if detail else ""
    return f"{result.command_line} exited with status {result.returncode}{suffix}"


def _run_layout_command(
    runner: CommandRunner, argv: tuple[str, ...], *, fs_type: str, stripe_text: str
) -> LayoutResult:
    """Run one layout command and turn its outcome into a result; never raises for it."""
    label = {"lustre": "Lustre", "beegfs": "BeeGFS"}.get(fs_type, fs_type)
    fallback = f"shards written with the default {label} layout"
    commands = (argv,)
    try:
        result = runner(argv)
    except CommandNotFoundError:
        message = f"{argv[0]} not found on PATH: {fallback}"
    except StorageError as exc:
        message = f"{exc}: {fallback}"
    else:
        if result.ok:
            message = f"{label} layout {stripe_text} set: {shlex.join(argv)}"
            logger.info("%s", message)
            return LayoutResult(
                fs_type=fs_type,
                action="applied",
                stripe=stripe_text,
                commands=commands,
                message=message,
            )
        message = f"{_failure_text(result)}: {fallback}"
    logger.warning("%s", message)
    return LayoutResult(
        fs_type=fs_type, action="failed", stripe=stripe_text, commands=commands, message=message
    )


def _cap(count: int, ost_count: int | None) -> int:
    if ost_count is None:
        return count
    if count == -1:
        return ost_count
    return min(count, ost_count)


def _lustre_pfl_argv(spec: StripeSpec, ost_count: int | None, dst: str) -> tuple[str, ...]:
    last_count = _cap(spec.count, ost_count)
    second_count = _cap(_PFL_SECOND_COUNT, ost_count)
    if last_count != -1:
        second_count = min(second_count, last_count)
    size = lfs_size(spec.size_bytes)
    components = (
        (_PFL_FIRST_END, 1, lfs_size(SMALL_STRIPE_BYTES)),
        (_PFL_SECOND_END, second_count, size),
        ("-1", last_count, size),
    )
    argv = ["lfs", "setstripe"]
    for end, count, stripe_size in components:
        argv += ["-E", end, "-c", str(count), "-S", stripe_size]
    return (*argv, dst)


def _apply_lustre(
    dst: str, stripe: str | StripeSpec, shard_size_bytes: int, runner: CommandRunner
) -> LayoutResult:
    if isinstance(stripe, StripeSpec) and not stripe.progressive:
        spec = stripe  # explicit layout: used as given, no need to count OSTs
    else:
        ost_count = lustre_ost_count(dst, runner)
        if stripe == "auto":
            spec = plan_stripe(shard_size_bytes, ost_count)
        else:
            spec = stripe if isinstance(stripe, StripeSpec) else DEFAULT_PFL
            argv = _lustre_pfl_argv(spec, ost_count, dst)
            return _run_layout_command(runner, argv, fs_type="lustre", stripe_text=spec.to_text())
    argv = ("lfs", "setstripe", "-c", str(spec.count), "-S", lfs_size(spec.size_bytes), dst)
    return _run_layout_command(runner, argv, fs_type="lustre", stripe_text=spec.to_text())


def _apply_beegfs(
    dst: str, stripe: str | StripeSpec, shard_size_bytes: int, runner: CommandRunner
) -> LayoutResult:
    if isinstance(stripe, StripeSpec):
        if stripe.count == -1:
            raise UsageError(
                "stripe count -1 (all OSTs) is Lustre-only: give BeeGFS a number of targets"
            )
        spec = StripeSpec(count=stripe.count, size_bytes=stripe.size_bytes)
    else:
        if stripe == "pfl":
            logger.info("progressive layouts are Lustre-only: planning a BeeGFS raid0 pattern")
        spec = plan_stripe(shard_size_bytes, None)
    argv = (
        "beegfs-ctl",
        "--setpattern",
        "--pattern=raid0",
        f"--chunksize={beegfs_size(spec.size_bytes)}",
        f"--numtargets={spec.count}",
        dst,
    )
    return _run_layout_command(runner, argv, fs_type="beegfs", stripe_text=spec.to_text())


def _ensure_directory(dst: str) -> None:
    # `lfs setstripe` on a missing path creates an empty *file* with that layout, so the
    # directory must exist before any layout command runs.
    try:
        Path(dst).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot create destination directory {dst}: {exc.strerror}") from exc


def apply_layout(
    dst_dir: str | os.PathLike[str],
    *,
    fs_type: str,
    stripe: str | StripeSpec,
    shard_size_bytes: int,
    runner: CommandRunner = run_command,
) -> LayoutResult:
    """Set the stripe layout of a destination directory before shards are written into it.

    On Lustre and BeeGFS the directory is created first if missing (``lfs setstripe`` on a
    missing path would create a file). On Lustre, ``auto`` plans with :func:`plan_stripe`
    (querying ``lfs df`` for the OST count) and runs ``lfs setstripe -c COUNT -S SIZE DST``;
    ``pfl`` (or a progressive :class:`StripeSpec`) runs a three-component progressive layout
    ``-E 64M -c 1 -S 1M -E 1G -c 4 -S 4M -E -1 -c 8 -S 4M``, counts capped by the OST count.
    On BeeGFS it runs ``beegfs-ctl --setpattern --pattern=raid0`` (``pfl`` plans as ``auto``).
    Any other filesystem is left alone, with an INFO log line.

    Args:
        dst_dir: the directory the shards will be written into.
        fs_type: the filesystem type, from :func:`~shardio.storage.fsdetect.resolve_fs_type`.
        stripe: ``auto``, ``none``, ``pfl``, ``COUNTxSIZE`` text, or a :class:`StripeSpec`.
        shard_size_bytes: the target shard size, used by ``auto``.
        runner: runs the external commands.

    Returns:
        What was done. A missing ``lfs``/``beegfs-ctl`` or a failing command gives action
        ``failed`` and a WARNING log line, not an exception.

    Raises:
        UsageError: ``stripe`` is invalid, or a count of -1 is asked of BeeGFS.
        StorageError: the destination directory cannot be created.
    """
    setting = parse_stripe(stripe) if isinstance(stripe, str) else stripe
    if shard_size_bytes <= 0:
        raise UsageError(f"shard size must be positive, got {shard_size_bytes} bytes")
    dst = os.fspath(dst_dir)
    if setting == "none":
        message = f"striping disabled: {dst} keeps its {fs_type} layout"
        logger.info("%s", message)
        return LayoutResult(
            fs_type=fs_type, action="none", stripe=None, commands=(), message=message
        )
    if fs_type not in ("lustre", "beegfs"):
        if fs_type in PARALLEL_FS or fs_type in NETWORK_FS:
            message = f"{fs_type} filesystem: layout is managed by the filesystem, no striping"
        else:
            message = f"local filesystem {fs_type}: no striping"
        logger.info("%s", message)
        return LayoutResult(
            fs_type=fs_type, action="skipped", stripe=None, commands=(), message=message
        )
    _ensure_directory(dst)
    if fs_type == "lustre":
        return _apply_lustre(dst, setting, shard_size_bytes, runner)
    return _apply_beegfs(dst, setting, shard_size_bytes, runner)


def describe_layout(
    path: str | os.PathLike[str], *, fs_type: str, runner: CommandRunner = run_command
) -> str:
    """Describe the stripe layout of a path, for ``shardio inspect``.

    Args:
        path: a file or directory.
        fs_type: the filesystem type of ``path``.
        runner: runs ``lfs getstripe -d`` (Lustre) or ``beegfs-ctl --getentryinfo`` (BeeGFS).

    Returns:
        The tool's output, stripped; ``n/a (ext4)`` on filesystems without striping; or
        ``unknown (REASON)`` when the tool is missing or fails. Never raises for those.
    """
    target = os.fspath(path)
    if fs_type == "lustre":
        argv: tuple[str, ...] = ("lfs", "getstripe", "-d", target)
    elif fs_type == "beegfs":
        argv = ("beegfs-ctl", "--getentryinfo", target)
    else:
        return f"n/a ({fs_type})"
    try:
        result = runner(argv)
    except CommandNotFoundError:
        reason = f"{argv[0]} not found"
    except StorageError as exc:
        reason = str(exc)
    else:
        if result.ok:
            return result.stdout.strip()
        reason = f"{argv[0]} exited with status {result.returncode}"
    logger.info("layout of %s unknown: %s", target, reason)
    return f"unknown ({reason})"
