"""Tests for stripe planning and layout commands, recorded by the fakes of lfs and beegfs-ctl
(tests/fakebin)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import pytest

from shardio.errors import FormatError, StorageError, UsageError
from shardio.storage.runner import CommandResult, run_command
from shardio.storage.stripe_spec import StripeSpec, parse_stripe, plan_stripe
from shardio.storage.striping import (
    LayoutResult,
    apply_layout,
    describe_layout,
    lustre_ost_count,
)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
LOGGER = "shardio.storage.striping"


class FakeCommands(Protocol):
    """The ``fake_commands`` fixture from conftest.py, as these tests use it."""

    def calls(self) -> list[list[str]]: ...

    def fail_with(self, returncode: int) -> None: ...

    def set_ost_count(self, count: int) -> None: ...


@pytest.fixture
def no_commands_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


# --- StripeSpec and parse_stripe -------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "size_bytes", "text"),
    [
        (4, 4 * MiB, "4x4MiB"),
        (1, 64 * KiB, "1x64KiB"),
        (-1, 1 * GiB, "-1x1GiB"),
        (2, 192 * KiB, "2x192KiB"),
    ],
)
def test_stripe_spec_text(count: int, size_bytes: int, text: str) -> None:
    spec = StripeSpec(count=count, size_bytes=size_bytes)
    assert spec.to_text() == text
    assert parse_stripe(text) == spec


def test_progressive_spec_text_is_pfl() -> None:
    assert StripeSpec(count=8, size_bytes=4 * MiB, progressive=True).to_text() == "pfl"


@pytest.mark.parametrize(
    ("count", "size_bytes"),
    [(0, 4 * MiB), (-2, 4 * MiB), (4, 32 * KiB), (4, 100 * KiB), (4, 0)],
)
def test_stripe_spec_rejects_invalid_values(count: int, size_bytes: int) -> None:
    with pytest.raises(UsageError):
        StripeSpec(count=count, size_bytes=size_bytes)


def test_stripe_spec_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        StripeSpec(4, 4 * MiB)  # type: ignore[call-arg]
    spec = StripeSpec(count=4, size_bytes=4 * MiB)
    with pytest.raises(AttributeError):
        spec.count = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("auto", "auto"),
        ("none", "none"),
        ("pfl", "pfl"),
        (" PFL ", "pfl"),
        ("8x4MiB", StripeSpec(count=8, size_bytes=4 * MiB)),
        ("4x1M", StripeSpec(count=4, size_bytes=1 * MiB)),
        ("4x1m", StripeSpec(count=4, size_bytes=1 * MiB)),
        ("-1x4MiB", StripeSpec(count=-1, size_bytes=4 * MiB)),
        ("2X512K", StripeSpec(count=2, size_bytes=512 * KiB)),
        ("1 x 1G", StripeSpec(count=1, size_bytes=1 * GiB)),
        ("1x65536", StripeSpec(count=1, size_bytes=64 * KiB)),
    ],
)
def test_parse_stripe_accepts(text: str, expected: str | StripeSpec) -> None:
    assert parse_stripe(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "fast",
        "8",
        "x4M",
        "4x",
        "0x4MiB",
        "-2x4M",
        "4x100K",
        "4x32K",
        "4x4MB",
        "4x1.5M",
        "4*4M",
    ],
)
def test_parse_stripe_rejects_with_one_line_naming_input(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_stripe(text)
    message = str(info.value)
    assert message.startswith(f"invalid stripe {text!r}: ")
    assert "\n" not in message


# --- plan_stripe -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shard_size_bytes", "ost_count", "count", "size_bytes"),
    [
        (1 * GiB, None, 4, 4 * MiB),
        (1 * GiB, 4, 4, 4 * MiB),
        (1 * GiB, 2, 2, 4 * MiB),
        (256 * MiB, None, 1, 4 * MiB),
        (300 * MiB, None, 2, 4 * MiB),
        (64 * MiB, None, 1, 4 * MiB),
        (63 * MiB, None, 1, 1 * MiB),
        (1 * MiB, 1, 1, 1 * MiB),
        (2 * GiB, 100, 8, 4 * MiB),
        (100 * GiB, None, 8, 4 * MiB),
        (100 * GiB, 3, 3, 4 * MiB),
    ],
)
def test_plan_stripe(
    shard_size_bytes: int, ost_count: int | None, count: int, size_bytes: int
) -> None:
    spec = plan_stripe(shard_size_bytes, ost_count)
    assert spec == StripeSpec(count=count, size_bytes=size_bytes)


def test_plan_stripe_rejects_non_positive_inputs() -> None:
    with pytest.raises(UsageError):
        plan_stripe(0, None)
    with pytest.raises(UsageError):
        plan_stripe(1 * GiB, 0)


# --- lustre_ost_count ------------------------------------------------------------------------


def test_ost_count_from_lfs_df(fake_commands: FakeCommands, tmp_path: Path) -> None:
    assert lustre_ost_count(tmp_path, run_command) == 4
    fake_commands.set_ost_count(16)
    assert lustre_ost_count(tmp_path, run_command) == 16
    assert fake_commands.calls() == [["lfs", "df", str(tmp_path)]] * 2


def test_ost_count_is_none_with_warning_when_lfs_fails(
    fake_commands: FakeCommands, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake_commands.fail_with(5)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert lustre_ost_count(tmp_path, run_command) is None
    assert "exited with status 5" in caplog.text


@pytest.mark.usefixtures("no_commands_on_path")
def test_ost_count_is_none_when_lfs_missing_and_leaves_the_warning_to_setstripe(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert lustre_ost_count(tmp_path, run_command) is None
    assert "lfs not found on PATH" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_ost_count_ignores_mdts_and_summary() -> None:
    stdout = (
        "UUID  1K-blocks  Used  Available  Use%  Mounted on\n"
        "fs-MDT0000_UUID  10  1  9  10%  /mnt/fs[MDT:0]\n"
        "fs-OST0000_UUID  10  1  9  10%  /mnt/fs[OST:0]\n"
        "fs-OST0001_UUID  : inactive device\n"
        "fs-OST0002_UUID  10  1  9  10%  /mnt/fs[OST:2]\n"
        "\nfilesystem_summary:  20  2  18  10%  /mnt/fs\n"
    )

    def runner(argv: Sequence[str], *, timeout_s: float = 60.0) -> CommandResult:
        return CommandResult(argv=tuple(argv), returncode=0, stdout=stdout, stderr="")

    assert lustre_ost_count("/mnt/fs", runner) == 2


# --- apply_layout on Lustre ------------------------------------------------------------------


def test_lustre_auto_records_planned_setstripe(fake_commands: FakeCommands, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    result = apply_layout(dst, fs_type="lustre", stripe="auto", shard_size_bytes=1 * GiB)
    setstripe = ["lfs", "setstripe", "-c", "4", "-S", "4M", str(dst)]
    assert fake_commands.calls() == [["lfs", "df", str(dst)], setstripe]
    assert result.action == "applied"
    assert result.fs_type == "lustre"
    assert result.stripe == "4x4MiB"
    assert result.commands == (tuple(setstripe),)
    assert dst.is_dir()  # created first: `lfs setstripe` on a missing path makes a file


def test_lustre_auto_caps_count_by_ost_count(fake_commands: FakeCommands, tmp_path: Path) -> None:
    fake_commands.set_ost_count(2)
    apply_layout(tmp_path, fs_type="lustre", stripe="auto", shard_size_bytes=4 * GiB)
    assert fake_commands.calls()[-1] == [
        "lfs",
        "setstripe",
        "-c",
        "2",
        "-S",
        "4M",
        str(tmp_path),
    ]


def test_lustre_small_shards_get_1m_stripes(fake_commands: FakeCommands, tmp_path: Path) -> None:
    apply_layout(tmp_path, fs_type="lustre", stripe="auto", shard_size_bytes=16 * MiB)
    assert fake_commands.calls()[-1] == [
        "lfs",
        "setstripe",
        "-c",
        "1",
        "-S",
        "1M",
        str(tmp_path),
    ]


@pytest.mark.parametrize(
    ("stripe", "count", "size"),
    [
        ("8x1M", "8", "1M"),
        ("-1x4MiB", "-1", "4M"),
        (StripeSpec(count=2, size_bytes=192 * KiB), "2", "192K"),
    ],
)
def test_lustre_explicit_spec_skips_lfs_df(
    fake_commands: FakeCommands,
    tmp_path: Path,
    stripe: str | StripeSpec,
    count: str,
    size: str,
) -> None:
    result = apply_layout(tmp_path, fs_type="lustre", stripe=stripe, shard_size_bytes=1 * GiB)
    assert fake_commands.calls() == [["lfs", "setstripe", "-c", count, "-S", size, str(tmp_path)]]
    assert result.action == "applied"


@pytest.mark.parametrize(
    ("ost_count", "counts"),
    [(16, ("1", "4", "8")), (4, ("1", "4", "4")), (2, ("1", "2", "2"))],
)
def test_lustre_pfl_records_progressive_layout(
    fake_commands: FakeCommands,
    tmp_path: Path,
    ost_count: int,
    counts: tuple[str, str, str],
) -> None:
    fake_commands.set_ost_count(ost_count)
    result = apply_layout(tmp_path, fs_type="lustre", stripe="pfl", shard_size_bytes=1 * GiB)
    first, second, last = counts
    expected = [
        "lfs", "setstripe",
        "-E", "64M", "-c", first, "-S", "1M",
        "-E", "1G", "-c", second, "-S", "4M",
        "-E", "-1", "-c", last, "-S", "4M",
        str(tmp_path),
    ]  # fmt: skip
    assert fake_commands.calls() == [["lfs", "df", str(tmp_path)], expected]
    assert result.action == "applied"
    assert result.stripe == "pfl"
    assert result.commands == (tuple(expected),)


def test_lustre_pfl_without_ost_count_uses_article_counts(
    fake_commands: FakeCommands, tmp_path: Path
) -> None:
    fake_commands.set_ost_count(0)  # lfs df lists no OST: count unknown, nothing capped
    apply_layout(tmp_path, fs_type="lustre", stripe="pfl", shard_size_bytes=1 * GiB)
    first_two = ["-E", "64M", "-c", "1", "-S", "1M", "-E", "1G", "-c", "4", "-S", "4M"]
    assert fake_commands.calls()[-1][2:-1] == [*first_two, "-E", "-1", "-c", "8", "-S", "4M"]


def test_none_runs_nothing(fake_commands: FakeCommands, tmp_path: Path) -> None:
    result = apply_layout(tmp_path, fs_type="lustre", stripe="none", shard_size_bytes=1 * GiB)
    assert fake_commands.calls() == []
    assert result.action == "none"
    assert result.stripe is None
    assert result.commands == ()


@pytest.mark.usefixtures("no_commands_on_path")
def test_missing_lfs_fails_softly_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = apply_layout(tmp_path, fs_type="lustre", stripe="auto", shard_size_bytes=1 * GiB)
    assert result.action == "failed"
    assert result.message == "lfs not found on PATH: shards written with the default Lustre layout"
    assert result.commands == (("lfs", "setstripe", "-c", "4", "-S", "4M", str(tmp_path)),)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert result.message in warnings


def test_failing_lfs_gives_failed_with_its_error(
    fake_commands: FakeCommands, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake_commands.fail_with(1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = apply_layout(tmp_path, fs_type="lustre", stripe="8x4M", shard_size_bytes=1 * GiB)
    assert fake_commands.calls() == [["lfs", "setstripe", "-c", "8", "-S", "4M", str(tmp_path)]]
    assert result.action == "failed"
    assert "exited with status 1" in result.message
    assert "Operation not permitted" in result.message
    assert result.message.endswith("shards written with the default Lustre layout")
    assert "\n" not in result.message
    assert any(r.levelno == logging.WARNING for r in caplog.records)


def test_destination_that_is_a_file_raises_storage_error(
    fake_commands: FakeCommands, tmp_path: Path
) -> None:
    target = tmp_path / "file"
    target.write_bytes(b"x")
    with pytest.raises(StorageError, match="file"):
        apply_layout(target, fs_type="lustre", stripe="auto", shard_size_bytes=1 * GiB)
    assert fake_commands.calls() == []


def test_invalid_stripe_text_raises_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="invalid stripe"):
        apply_layout(tmp_path, fs_type="ext4", stripe="wide", shard_size_bytes=1 * GiB)


def test_injected_runner_receives_commands(tmp_path: Path) -> None:
    seen: list[tuple[str, ...]] = []

    def runner(argv: Sequence[str], *, timeout_s: float = 60.0) -> CommandResult:
        seen.append(tuple(argv))
        return CommandResult(argv=tuple(argv), returncode=0, stdout="", stderr="")

    result = apply_layout(
        tmp_path, fs_type="lustre", stripe="auto", shard_size_bytes=3 * GiB, runner=runner
    )
    assert seen == [
        ("lfs", "df", str(tmp_path)),
        ("lfs", "setstripe", "-c", "8", "-S", "4M", str(tmp_path)),
    ]
    assert result.action == "applied"


# --- apply_layout on BeeGFS and other filesystems --------------------------------------------


@pytest.mark.parametrize("stripe", ["auto", "pfl"])
def test_beegfs_records_setpattern(
    fake_commands: FakeCommands, tmp_path: Path, stripe: str
) -> None:
    result = apply_layout(tmp_path, fs_type="beegfs", stripe=stripe, shard_size_bytes=1 * GiB)
    assert fake_commands.calls() == [
        [
            "beegfs-ctl",
            "--setpattern",
            "--pattern=raid0",
            "--chunksize=4m",
            "--numtargets=4",
            str(tmp_path),
        ]
    ]
    assert result.action == "applied"
    assert result.stripe == "4x4MiB"


def test_beegfs_explicit_spec(fake_commands: FakeCommands, tmp_path: Path) -> None:
    apply_layout(tmp_path, fs_type="beegfs", stripe="2x512K", shard_size_bytes=1 * GiB)
    assert fake_commands.calls()[0][3:5] == ["--chunksize=512k", "--numtargets=2"]


def test_beegfs_rejects_all_targets(fake_commands: FakeCommands, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="Lustre-only"):
        apply_layout(tmp_path, fs_type="beegfs", stripe="-1x4M", shard_size_bytes=1 * GiB)
    assert fake_commands.calls() == []


@pytest.mark.usefixtures("no_commands_on_path")
def test_missing_beegfs_ctl_fails_softly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = apply_layout(tmp_path, fs_type="beegfs", stripe="auto", shard_size_bytes=1 * GiB)
    assert result.action == "failed"
    assert result.message == (
        "beegfs-ctl not found on PATH: shards written with the default BeeGFS layout"
    )
    assert "beegfs-ctl not found" in caplog.text


@pytest.mark.parametrize("fs_type", ["ext4", "xfs", "tmpfs", "overlay", "local", "unknown"])
def test_local_filesystem_is_logged_no_op(
    fake_commands: FakeCommands,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    fs_type: str,
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        result = apply_layout(tmp_path, fs_type=fs_type, stripe="auto", shard_size_bytes=1 * GiB)
    assert fake_commands.calls() == []
    assert result.action == "skipped"
    assert result.commands == ()
    assert result.message == f"local filesystem {fs_type}: no striping"
    assert result.message in [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]


def test_gpfs_is_skipped(fake_commands: FakeCommands, tmp_path: Path) -> None:
    result = apply_layout(tmp_path, fs_type="gpfs", stripe="pfl", shard_size_bytes=1 * GiB)
    assert fake_commands.calls() == []
    assert result.action == "skipped"


# --- LayoutResult ----------------------------------------------------------------------------


def test_layout_result_json_round_trip() -> None:
    result = LayoutResult(
        fs_type="lustre",
        action="applied",
        stripe="4x4MiB",
        commands=(("lfs", "setstripe", "-c", "4", "-S", "4M", "/d"),),
        message="ok",
    )
    data = result.to_json()
    assert data == {
        "fs_type": "lustre",
        "action": "applied",
        "stripe": "4x4MiB",
        "commands": [["lfs", "setstripe", "-c", "4", "-S", "4M", "/d"]],
        "message": "ok",
    }
    assert LayoutResult.from_json(json.loads(json.dumps(data))) == result


def test_layout_result_validation() -> None:
    with pytest.raises(UsageError):
        LayoutResult(fs_type="ext4", action="done", stripe=None, commands=(), message="")
    with pytest.raises(FormatError):
        LayoutResult.from_json({"fs_type": "ext4"})
    with pytest.raises(FormatError):
        LayoutResult.from_json(
            {
                "fs_type": "ext4",
                "action": "none",
                "stripe": None,
                "commands": "x",
                "message": "",
            }
        )
    with pytest.raises(FormatError):
        LayoutResult.from_json(
            {
                "fs_type": "ext4",
                "action": "bad",
                "stripe": None,
                "commands": [],
                "message": "",
            }
        )


# --- describe_layout -------------------------------------------------------------------------


def test_describe_lustre(fake_commands: FakeCommands, tmp_path: Path) -> None:
    text = describe_layout(tmp_path, fs_type="lustre")
    assert text == "stripe_count:  4 stripe_size:   4194304 pattern:       raid0 stripe_offset: -1"
    assert fake_commands.calls() == [["lfs", "getstripe", "-d", str(tmp_path)]]


def test_describe_beegfs(fake_commands: FakeCommands, tmp_path: Path) -> None:
    text = describe_layout(tmp_path, fs_type="beegfs")
    assert "+ Type: RAID0" in text
    assert text == text.strip()
    assert fake_commands.calls() == [["beegfs-ctl", "--getentryinfo", str(tmp_path)]]


def test_describe_local(fake_commands: FakeCommands, tmp_path: Path) -> None:
    assert describe_layout(tmp_path, fs_type="ext4") == "n/a (ext4)"
    assert fake_commands.calls() == []


@pytest.mark.usefixtures("no_commands_on_path")
def test_describe_missing_tool(tmp_path: Path) -> None:
    assert describe_layout(tmp_path, fs_type="lustre") == "unknown (lfs not found)"
    assert describe_layout(tmp_path, fs_type="beegfs") == "unknown (beegfs-ctl not found)"


def test_describe_failing_tool(fake_commands: FakeCommands, tmp_path: Path) -> None:
    fake_commands.fail_with(2)
    assert describe_layout(tmp_path, fs_type="lustre") == "unknown (lfs exited with status 2)"
