"""Rank variables are parsed strictly: a malformed one is refused, never read as rank 0 of 1.

Before, ``SLURM_PROCID=-1`` (or ``abc``, ``²``, 5,000 digits) made :func:`detect_ranks`
fall through to "rank 0 of 1", so that rank read the whole dataset.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from shardio._env import env_flag, parse_env_int, parse_tasks_per_node
from shardio.errors import UsageError
from shardio.order.ranks import RankInfo, detect_ranks

MALFORMED = [
    "-1",
    "abc",
    "²",  # str.isdigit() takes it
    "٣",  # Arabic-Indic three: int() takes it
    "1" * 5000,  # int() refuses over 4,300 digits; a bound must come first
    "+1",
    " 1",
    "1 ",
    "1\n",
    "1_000",  # int() takes it
    "01",
    "1.0",
    "0x1",
    "",
    "1234567890",  # 10 digits: past the bound
]


def refused(env: Mapping[str, str], *needles: str) -> str:
    with pytest.raises(UsageError) as info:
        detect_ranks(env)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


@pytest.mark.parametrize("value", MALFORMED, ids=repr)
@pytest.mark.parametrize(
    ("name", "env"),
    [
        ("SLURM_PROCID", {"SLURM_NTASKS": "4"}),
        ("SLURM_NTASKS", {"SLURM_PROCID": "1"}),
        ("SLURM_LOCALID", {"SLURM_PROCID": "1", "SLURM_NTASKS": "4"}),
        ("SLURM_NTASKS_PER_NODE", {"SLURM_PROCID": "1", "SLURM_NTASKS": "4"}),
        ("RANK", {"WORLD_SIZE": "4"}),
        ("WORLD_SIZE", {"RANK": "1"}),
        ("LOCAL_RANK", {"RANK": "1", "WORLD_SIZE": "4"}),
        ("LOCAL_WORLD_SIZE", {"RANK": "1", "WORLD_SIZE": "4"}),
    ],
)
def test_a_malformed_rank_variable_is_refused_naming_it(
    name: str, env: dict[str, str], value: str
) -> None:
    message = refused(env | {name: value}, f"{name}=")
    assert len(message) < 300  # 5,000 digits are shown cut


def test_a_huge_value_is_shown_cut() -> None:
    message = refused({"SLURM_PROCID": "7" * 5000, "SLURM_NTASKS": "4"}, "5,000 characters")
    assert "7" * 41 not in message


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "SLURM_PROCID=4 is not a rank"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, "SLURM_NTASKS=0 is out of range"),
        ({"RANK": "9", "WORLD_SIZE": "8"}, "RANK=9"),
        (
            {"SLURM_PROCID": "1", "SLURM_NTASKS": "8", "SLURM_LOCALID": "4",
             "SLURM_NTASKS_PER_NODE": "4"},
            "SLURM_LOCALID=4 is not a local rank of a node of 4",
        ),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "4"}, "LOCAL_RANK=4"),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8 is more"),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4(x"}, "4(x"),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "0"}, "0 tasks"),
        # torchrun inside a one-task-per-node srun: both pairs set, and they disagree
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "RANK": "5", "WORLD_SIZE": "16"},
            "say rank 0 of 2 but RANK/WORLD_SIZE say rank 5 of 16",
        ),
    ],
)  # fmt: skip
def test_inconsistent_ranks_are_refused(env: dict[str, str], needle: str) -> None:
    refused(env, needle)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, RankInfo()),
        ({"SLURM_PROCID": "0"}, RankInfo()),  # a batch script's shell: no task count
        ({"SLURM_NTASKS": "8"}, RankInfo()),  # salloc's shell: no task of its own
        (
            {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
             "SLURM_NTASKS_PER_NODE": "4"},
            RankInfo(rank=5, world_size=8, local_rank=1, source="slurm", ranks_per_node=4),
        ),
        (
            {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_NTASKS_PER_NODE": "2(x3)"},
            RankInfo(rank=5, world_size=6, source="slurm", ranks_per_node=2),
        ),
        (  # nodes with different task counts: no single ranks-per-node
            {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_NTASKS_PER_NODE": "4,2"},
            RankInfo(rank=5, world_size=6, source="slurm", ranks_per_node=0),
        ),
        (  # bind.sh exports RANK/WORLD_SIZE from SLURM's: they agree
            {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "RANK": "3", "WORLD_SIZE": "4"},
            RankInfo(rank=3, world_size=4, source="slurm"),
        ),
        (
            {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
            RankInfo(rank=3, world_size=8, local_rank=1, source="env", ranks_per_node=2),
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "999999999"},
            RankInfo(rank=0, world_size=999_999_999, source="env"),
        ),
    ],
)  # fmt: skip
def test_well_formed_ranks(env: dict[str, str], expected: RankInfo) -> None:
    assert detect_ranks(env) == expected


def test_the_parser_takes_only_ascii_digits() -> None:
    assert parse_env_int("X", "0") == 0
    assert parse_env_int("X", "999999999") == 999_999_999
    for value in MALFORMED:
        with pytest.raises(UsageError, match=r"^X="):
            parse_env_int("X", value)
    with pytest.raises(UsageError, match="out of range"):
        parse_env_int("X", "5", maximum=4)


@pytest.mark.parametrize(
    ("text", "count"),
    [("8", 8), ("2(x3)", 2), ("4,4", 4), ("4(x2),4", 4), ("4,2", None), ("4(x2),2", None)],
)
def test_slurm_tasks_per_node_forms(text: str, count: int | None) -> None:
    assert parse_tasks_per_node("SLURM_NTASKS_PER_NODE", text) == count


@pytest.mark.parametrize("text", ["", "4(x)", "4(x2", "(x2)", "4,", "²", "4(x0)", "-4", " 4"])
def test_malformed_slurm_tasks_per_node(text: str) -> None:
    with pytest.raises(UsageError, match="SLURM_NTASKS_PER_NODE="):
        parse_tasks_per_node("SLURM_NTASKS_PER_NODE", text)


def test_switches() -> None:
    assert env_flag({}, "S", default=True)
    assert not env_flag({"S": "OFF"}, "S", default=True)
    assert env_flag({"S": "yes"}, "S", default=False)
    for bad in ("2", "maybe", " 0", "", "\uff10"):  # the last: a fullwidth zero
        with pytest.raises(UsageError, match=r"^S="):
            env_flag({"S": bad}, "S", default=True)


@pytest.mark.parametrize(
    ("env", "per_node", "local"),
    [
        ({}, 0, 0),  # unknown: one node
        ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}, 2, 1),
        ({"SLURM_NTASKS_PER_NODE": "2(x2)", "SLURM_LOCALID": "1"}, 2, 1),
        ({"LOCAL_WORLD_SIZE": "3"}, 0, 0),  # 4 ranks do not split into nodes of 3
    ],
)
def test_given_ranks_take_the_node_layout_of_the_environment(
    env: dict[str, str], per_node: int, local: int
) -> None:
    from shardio.order.ranks import given_ranks

    got = given_ranks(3, 4, env)
    assert (got.rank, got.world_size, got.ranks_per_node, got.local_rank) == (3, 4, per_node, local)
    assert got.source == "given"


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        ((4, 4), {}, "invalid rank 4 of world size 4"),
        ((0, 0), {}, "invalid rank 0 of world size 0"),
        ((0, 2), {"LOCAL_WORLD_SIZE": "abc"}, "LOCAL_WORLD_SIZE"),
        ((0, 2), {"LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE=4 is more than the world size 2"),
        ((0, 4), {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "2"}, "LOCAL_RANK=2"),
    ],
)
def test_given_ranks_refuse_a_bad_layout(
    args: tuple[int, int], env: dict[str, str], needle: str
) -> None:
    from shardio.order.ranks import given_ranks

    with pytest.raises(UsageError, match=needle):
        given_ranks(*args, env)
