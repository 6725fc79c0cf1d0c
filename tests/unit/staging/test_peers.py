"""Re-staging after a lost node: survivors keep their verified copies, the moved share comes
from peers' areas (verified, same dataset only) before the source, and the report says so."""

from __future__ import annotations

import os

import pytest

from shardio.errors import UsageError
from shardio.order import OrderSpec
from shardio.staging import StageOptions, stage_dataset

SPEC = OrderSpec.parse("order=random,seed=3,partition=node")


def _stage(src, dest, node: int, nodes: int, peers=()):
    opts = StageOptions(node=node, num_nodes=nodes, spec=SPEC, peers=tuple(map(str, peers)))
    return stage_dataset(src.path, dest, opts)


def _stage_all(src, root, nodes: int):
    return [_stage(src, root / f"area-{i}", i, nodes) for i in range(nodes)]


def test_losing_the_last_node_moves_only_its_share_from_peers(tiny_src, tmp_path):
    first = _stage_all(tiny_src, tmp_path, 4)
    total = sum(r.bytes_staged for r in first)
    assert total == tiny_src.size_of(tiny_src.rels)  # the shares cover the dataset once
    lost = first[3].bytes_staged
    moved = 0
    for node in range(3):  # node 3 lost: the survivors restage for 3 nodes
        before = tiny_src.staged(tmp_path / f"area-{node}")
        got = _stage(tiny_src, tmp_path / f"area-{node}", node, 3, peers=[tmp_path / "area-*"])
        after = tiny_src.staged(tmp_path / f"area-{node}")
        assert before <= after  # every copy kept
        assert got.bytes_kept == first[node].bytes_staged
        assert got.bytes_from_source == 0  # all from the lost node's area (still readable)
        assert got.peers == 3  # the other three areas, not its own
        moved += got.bytes_from_peers
        tiny_src.assert_staged_ok(tmp_path / f"area-{node}")
    assert moved == lost <= total / 4 + max(s.size_bytes for s in tiny_src.manifest.shards)
    # ... and back to 4 nodes: the new node takes its share, the others keep theirs
    back = _stage(tiny_src, tmp_path / "new-3", 3, 4, peers=[tmp_path / "area-*"])
    assert back.bytes_from_peers == lost and back.bytes_from_source == 0
    assert all(_stage(tiny_src, tmp_path / f"area-{i}", i, 4).bytes_kept == first[i].bytes_staged
               for i in range(3))  # fmt: skip


def test_without_peers_the_moved_share_comes_from_the_source(tiny_src, tmp_path):
    first = _stage_all(tiny_src, tmp_path, 3)
    got = _stage(tiny_src, tmp_path / "area-0", 0, 2)
    assert got.bytes_kept == first[0].bytes_staged
    assert got.bytes_from_peers == 0 and got.bytes_from_source > 0
    assert got.bytes_kept + got.bytes_from_source == got.bytes_staged


def test_a_foreign_area_is_refused_and_never_read(tiny_src, big_src, tmp_path):
    other = tmp_path / "other"
    stage_dataset(big_src.path, other, StageOptions())
    with pytest.raises(UsageError, match=r"^peer .*other holds dataset .*, not dataset .*"):
        _stage(tiny_src, tmp_path / "mine", 0, 2, peers=[other])
    assert not (tmp_path / "mine").exists()  # refused before anything was written
    # matched by a glob: skipped with a warning, the source read instead
    got = _stage(tiny_src, tmp_path / "mine", 0, 2, peers=[tmp_path / "oth*"])
    assert got.peers == 0 and got.bytes_from_peers == 0
    # a look-alike: the same shard paths copied by hand, no marker
    fake = tmp_path / "fake"
    for rel in tiny_src.rels:
        os.makedirs(fake / os.path.dirname(rel), exist_ok=True)
        (fake / rel).write_bytes((tiny_src.path / rel).read_bytes())
    with pytest.raises(UsageError, match="is not a shardio staging area"):
        _stage(tiny_src, tmp_path / "mine2", 0, 2, peers=[fake])


def test_a_symlinked_peer_is_refused(tiny_src, tmp_path):
    _stage(tiny_src, tmp_path / "real", 0, 1)
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(UsageError, match=r"^peer .*link is a symlink"):
        _stage(tiny_src, tmp_path / "mine", 0, 2, peers=[tmp_path / "link"])
    got = _stage(tiny_src, tmp_path / "mine", 0, 2, peers=[tmp_path / "li*"])
    assert got.peers == 0 and got.bytes_from_peers == 0
    # a symlinked copy inside a real peer area is not followed either
    peer = tmp_path / "real"
    rel = tiny_src.rels[0]
    os.unlink(peer / rel)
    os.symlink(tiny_src.path / rel, peer / rel)
    got = _stage(tiny_src, tmp_path / "solo", 0, 1, peers=[peer])
    assert got.bytes_from_source == tiny_src.size_of([rel])
    assert os.path.islink(peer / rel)  # a peer is only read


def test_a_damaged_peer_copy_is_not_used(tiny_src, tmp_path):
    peer = tmp_path / "peer"
    _stage(tiny_src, peer, 0, 1)
    rel = tiny_src.rels[2]
    data = bytearray((peer / rel).read_bytes())
    data[len(data) // 2] ^= 0xFF
    os.chmod(peer / rel, 0o644)
    (peer / rel).write_bytes(bytes(data))
    got = _stage(tiny_src, tmp_path / "mine", 0, 1, peers=[peer])
    assert got.bytes_from_source == tiny_src.size_of([rel])
    assert got.bytes_from_peers == tiny_src.size_of(set(tiny_src.rels) - {rel})
    tiny_src.assert_staged_ok(tmp_path / "mine", set(tiny_src.rels))


def test_the_cli_reports_what_moved(tiny_src, tmp_path, run_cli):
    for node in range(2):
        rc, out, err = run_cli(
            "stage", tiny_src.path, tmp_path / f"a{node}", "--node", f"{node}/2",
            "--order", str(SPEC), "--no-progress",
        )  # fmt: skip
        assert rc == 0, err
    rc, out, err = run_cli(
        "stage", tiny_src.path, tmp_path / "a0", "--node", "0/1", "--order", str(SPEC),
        "--peers", f"{tmp_path}/a*", "--no-progress",
    )  # fmt: skip
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("node 0/1: kept "))
    assert "from source 0 B (1 peer area(s))" in line, line
    for bad in (",", f"{tmp_path}/a1,,x"):
        rc, out, err = run_cli("stage", tiny_src.path, tmp_path / "a9", "--peers", bad)
        assert rc != 0 and len(err.strip().splitlines()) == 1, err
