"""Re-staging after a lost node: survivors keep their verified copies, the moved share comes
from peers' areas (verified, same dataset only) before the source, and the report says so."""

from __future__ import annotations

import os

import pytest

from shardio.errors import UsageError
from shardio.order import OrderSpec
from shardio.staging import StageOptions, stage_dataset

SPEC = OrderSpec.parse("order=random,seed=3,partition=node")


def _stage(src, dest, node: int, nodes: int, peers=(), keys=None):
    opts = StageOptions(
        node=node, num_nodes=nodes, spec=SPEC, peers=tuple(map(str, peers)), node_keys=keys
    )
    return stage_dataset(src.path, dest, opts)


def _stage_all(src, root, nodes: int):
    return [_stage(src, root / f"area-{i}", i, nodes) for i in range(nodes)]


@pytest.mark.parametrize("lost", [0, 3])
def test_losing_a_node_moves_little_and_from_peers(tiny_src, tmp_path, lost):
    """Node ``lost`` (the first or the last) goes; the survivors keep their host names
    (their node numbers shift when the first goes). Each keeps the copies still its own,
    takes the rest from the other areas (the lost one's still readable), never the source;
    the bytes that change node stay within twice the lost share (a re-deal moves most)."""
    names = ("h0", "h1", "h2", "h3")
    first = [_stage(tiny_src, tmp_path / n, i, 4, keys=names) for i, n in enumerate(names)]
    total = sum(r.bytes_staged for r in first)
    assert total == tiny_src.size_of(tiny_src.rels)  # the shares cover the dataset once
    survivors = tuple(n for i, n in enumerate(names) if i != lost)
    fetched = 0
    for i, name in enumerate(survivors):
        before = tiny_src.staged(tmp_path / name)
        got = _stage(tiny_src, tmp_path / name, i, 3, peers=[tmp_path / "h*"], keys=survivors)
        after = tiny_src.staged(tmp_path / name)
        assert before <= after  # every copy kept
        assert got.bytes_kept > first[names.index(name)].bytes_staged / 2
        assert got.bytes_from_source == 0  # all from the other areas (still readable)
        assert got.peers == 3  # the other three areas, not its own
        fetched += got.bytes_from_peers
        tiny_src.assert_staged_ok(tmp_path / name)
    assert first[lost].bytes_staged <= fetched <= 2 * first[lost].bytes_staged
    # ... and back to 4 nodes: the lost name comes back and takes its old share
    back = _stage(tiny_src, tmp_path / "new", lost, 4, peers=[tmp_path / "h*"], keys=names)
    assert back.bytes_staged == first[lost].bytes_staged and back.bytes_from_source == 0
    assert all(
        _stage(tiny_src, tmp_path / n, names.index(n), 4, keys=names).bytes_kept
        == first[names.index(n)].bytes_staged
        for n in survivors
    )


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
