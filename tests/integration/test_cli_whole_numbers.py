"""Whole-number options of stage, bench and topo: ASCII digits only, one line, exit 2.

``int()`` takes "٣" (an Arabic-Indic three), " 1", "+1" and "1_0", and 5,000 digits cost it
a ValueError of its own: each of these was once read as a number (or a traceback).
"""

from __future__ import annotations

import pytest

BAD = ["\u0663", " 1", "+1", "1_0", "01", "-1", "", "1" * 5000, "nan", "\u00b2"]


@pytest.mark.parametrize("value", BAD, ids=lambda v: ascii(v)[:12])
@pytest.mark.parametrize(
    ("command", "option"),
    [
        ("stage", "--seed"),
        ("stage", "--epoch"),
        ("stage", "--streams"),
        ("stage", "--ahead"),
        ("stage", "--window-shards"),
        ("stage", "--ranks-per-node"),
        ("bench", "--workers"),
        ("bench", "--batch"),
        ("bench", "--epochs"),
        ("bench", "--seed"),
        ("topo", "--local-rank"),
        ("topo", "--workers"),
    ],
)
def test_a_malformed_whole_number_is_one_line(
    command, option, value, tmp_path, run_cli_here, assert_cli_error
):
    _check_refused(command, option, value, tmp_path, run_cli_here, assert_cli_error)


@pytest.mark.parametrize(
    ("command", "option"), [("stage", "--seed"), ("bench", "--workers"), ("topo", "--workers")]
)
def test_the_command_refuses_it_in_one_line(command, option, tmp_path, run_cli, assert_cli_error):
    """The same through the real command, a process of its own, for each command."""
    _check_refused(command, option, "1" * 5000, tmp_path, run_cli, assert_cli_error)


def _check_refused(command, option, value, tmp_path, run, assert_cli_error):
    positional = {
        "stage": [str(tmp_path / "src"), str(tmp_path / "dest")],
        "bench": [str(tmp_path / "src")],
    }.get(command, [])
    result = run(command, *positional, f"{option}={value}")
    assert result.rc == 2, result
    line = assert_cli_error(result, option, "is not a whole number")
    assert len(line) < 300  # a 5,000-digit value is cut in the message
    assert not (tmp_path / "dest").exists()  # refused before anything was made


def test_large_valid_epoch_and_seed_are_taken(tmp_path, packed_small, run_cli):
    """The strict type keeps every value the library accepts: epochs past 10^9, 64-bit seeds."""
    ds, _ = packed_small()
    dest = tmp_path / "area"
    seed = str(2**64 - 1)
    rc, out, err = run_cli(
        "stage",
        ds,
        dest,
        "--node",
        "0/1",
        "--epoch",
        "1000000001",
        "--seed",
        seed,
        "--no-progress",
    )
    assert rc == 0, err
    assert "epoch 1000000001" in out
    assert f"seed={seed}" in out
