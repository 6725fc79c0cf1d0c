"""Node names: SLURM's host lists expanded strictly (bounded), checked against
SLURM_NODEID/SLURMD_NODENAME, carried by the rank layout, and used alike by the stager."""

from __future__ import annotations

import pytest

from shardio.cli.stage import _node_keys_of
from shardio.errors import UsageError
from shardio.order.hostlist import MAX_HOSTS, expand_hostlist
from shardio.order.ranks import RankInfo, detect_ranks, given_ranks, slurm_hosts


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[001-004,007],login1", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu007", "login1"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[098-100]", ["n098", "n099", "n100"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("a[3]-ib,b.x_y", ["a3-ib", "b.x_y"]),
        ("z2,a1", ["z2", "a1"]),  # the order written: SLURM_NODEID indexes it
    ],
)
def test_host_lists_expand(text, hosts) -> None:
    assert expand_hostlist(text) == tuple(hosts)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "is empty"),
        ("a[1-", r"'\[' without '\]'"),
        ("a]1", r"'\]' without '\['"),
        ("a[[1]]", "a bracket inside a bracket"),
        ("a[3-1]", "the range 3-1 runs high to low"),
        ("a[x]", "a bracket holds 'x'"),
        ("a[]", "a bracket holds ''"),
        ("a[1-2-3]", "a bracket holds '1-2-3'"),
        ("a[-1]", "a bracket holds '-1'"),
        ("a[1234567890]", "a bracket holds"),
        ("a,,b", "an empty host between commas"),
        ("a,", "an empty host between commas"),
        ("a b", "is not a host name"),
        ("a\nb", "is not a host name"),
        ("nöde", "is not a host name"),
        ("a[1-2],a2", "names host a2 twice"),
        ("n[0-999999999]", f"more than {MAX_HOSTS:,} hosts"),
        ("a[1-300]b[1-300]", f"more than {MAX_HOSTS:,} hosts"),
        (",".join(f"h{i}[0-9999]" for i in range(7)), f"more than {MAX_HOSTS:,} hosts"),
    ],
)
def test_malformed_host_lists_are_one_line(text, needle) -> None:
    with pytest.raises(UsageError, match=needle) as caught:
        expand_hostlist(text, name="SLURM_JOB_NODELIST")
    assert "\n" not in str(caught.value) and "SLURM_JOB_NODELIST" in str(caught.value)


def _slurm(rank: int, nodes: int, per_node: int, nodelist: str, **extra: str) -> dict:
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODEID": str(rank // per_node),
        **extra,
    }


def test_slurm_ranks_carry_the_host_names() -> None:
    env = _slurm(5, 3, 2, "gpu[07-08],gpu11", SLURMD_NODENAME="gpu11")
    layout = detect_ranks(env)
    assert layout.node_keys == ("gpu07", "gpu08", "gpu11")
    assert (layout.node, layout.node_key) == (2, "gpu11")
    assert layout.with_rank(0).node_keys == layout.node_keys
    assert given_ranks(5, 6, env).node_keys == layout.node_keys
    # the step's own list wins over the job's (srun on part of an allocation)
    step = env | {"SLURM_STEP_NODELIST": "gpu[08,11,12]", "SLURMD_NODENAME": "gpu12"}
    assert detect_ranks(step).node_keys == ("gpu08", "gpu11", "gpu12")
    # torchrun and a layout given in code: numbered nodes
    plain = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert detect_ranks(plain).node_keys is None and detect_ranks(plain).node_key == "1"
    assert detect_ranks(env | {"SLURM_PROCID": "4"}).node_keys == layout.node_keys
    # one node in the layout (tasks per node unknown): no names needed
    unknown = {k: v for k, v in env.items() if k != "SLURM_NTASKS_PER_NODE"}
    assert detect_ranks(unknown).node_keys is None


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        (
            _slurm(3, 2, 2, "n[1-2]", SLURMD_NODENAME="n1"),
            r"SLURMD_NODENAME='n1' is not host "
            r"SLURM_NODEID=1 of SLURM_JOB_NODELIST \('n2'\)",
        ),
        (_slurm(3, 2, 2, "n[1-2]", SLURM_NODEID="2"), "SLURM_NODEID=2 is not a node of"),
        (_slurm(3, 2, 2, "n[1-3]"), "names 3 host"),
        (_slurm(3, 2, 2, "n[1-2"), r"SLURM_JOB_NODELIST='n\[1-2'"),
        (_slurm(3, 2, 2, "n1", SLURM_STEP_NODELIST=""), "SLURM_STEP_NODELIST is empty"),
        (_slurm(3, 2, 2, "n[1-2]", SLURM_NODEID="-1"), "SLURM_NODEID='-1' is not a whole"),
    ],
)
def test_an_inconsistent_slurm_layout_is_refused_in_one_line(env, needle) -> None:
    with pytest.raises(UsageError, match=needle) as caught:
        detect_ranks(env)
    assert "\n" not in str(caught.value)


def test_rank_info_checks_its_names() -> None:
    with pytest.raises(UsageError, match="3 node names for 2 node"):
        RankInfo(rank=0, world_size=4, ranks_per_node=2, node_keys=("a", "b", "c"))
    with pytest.raises(UsageError, match="names a node twice"):
        RankInfo(rank=0, world_size=4, ranks_per_node=2, node_keys=("a", "a"))
    with pytest.raises(UsageError, match="tuple of node names"):
        RankInfo(rank=0, world_size=2, ranks_per_node=1, node_keys=["a", "b"])  # type: ignore[arg-type]


def test_the_stager_keys_its_share_as_training_does() -> None:
    env = _slurm(2, 2, 2, "node[1-2]", SLURMD_NODENAME="node2", SLURM_NNODES="2")
    assert _node_keys_of(env, 2, auto=True) == detect_ranks(env).node_keys == ("node1", "node2")
    assert _node_keys_of({}, 1, auto=True) is None  # not under SLURM
    assert _node_keys_of(env, 3, auto=False) is None  # --node I/3 of another count: numbers
    with pytest.raises(UsageError, match="SLURM_NNODES=3 but the job's node list names 2"):
        _node_keys_of(env | {"SLURM_NNODES": "3"}, 3, auto=True)
    assert slurm_hosts({"SLURM_JOB_NODELIST": "a,b"}) == ("a", "b")
