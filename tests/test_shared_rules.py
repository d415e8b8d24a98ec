"""The rules the ledger, the prediction and the benchmark share: bytes received by link, hpZ's
secondary groups, padded shard sizes, text tables."""

from __future__ import annotations

import torch

from zpp_compile.reports import text_table
from zpp_compile.runtime.topology import (
    bytes_per_peer,
    local_index_groups,
    node_groups,
    peers_by_link,
    received_bytes,
    secondary_groups,
    secondary_member,
    world_received_bytes,
)
from zpp_compile.sharding import padding


def test_peers_are_counted_by_link_from_the_ranks_place():
    # 8 ranks, 4 per node: rank 5 sits on node 1 with ranks 4, 6, 7.
    assert peers_by_link(5, 4, range(8)) == (3, 4)
    assert peers_by_link(5, 4, (1, 5)) == (0, 1)  # qgZ's inter-node group of local index 1
    assert peers_by_link(0, 1, (0,)) == (0, 0)
    # An all-gather where each peer sends 10 bytes: 3 peers on the node, 4 elsewhere.
    assert received_bytes(*peers_by_link(5, 4, range(8)), 10) == (30, 40)
    assert world_received_bytes(8, 4, 10) == (30, 40)  # every rank's view of the world group is alike
    assert world_received_bytes(4, 4, 10) == (30, 0)


def test_peers_send_a_gathers_whole_input_and_a_reductions_chunk():
    # An all-gather of M = 40 bytes over 4 ranks: inputs of 10, each peer sends all of its 10, so
    # a rank receives 3 x 10 = M x (n-1)/n; a reduce-scatter of 40-byte inputs: each peer 40 / 4.
    assert bytes_per_peer(True, 10, 4) == 10
    assert bytes_per_peer(False, 40, 4) == 10


def test_node_groups_and_local_index_groups_follow_torchruns_numbering():
    assert node_groups(8, 4) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert local_index_groups(8, 4) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert local_index_groups(2, 2) == [(0,), (1,)]


def test_secondary_groups_are_consecutive_ranks():
    assert secondary_groups(8, 4) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert secondary_groups(4, 1) == [(0,), (1,), (2,), (3,)]
    for rank in range(8):
        group = next(g for g in secondary_groups(8, 2) if rank in g)
        assert group[secondary_member(rank, 2)] == rank


def test_shards_hold_whole_rows_padded_to_equal_size():
    assert padding.shard_numel(torch.empty(7, 3), 4) == 2 * 3  # ceil(7 / 4) rows of 3
    assert padding.shard_numel((7, 3), 4) == 6  # a shape counts as a parameter of that shape
    assert padding.padded_numel(torch.empty(7, 3), 4) == 24
    assert padding.shard_numel(torch.empty(5), 2) == 3
    assert padding.shard_numel(torch.tensor(1.0), 4) == 1  # 0-d: every rank holds it whole
    assert padding.shard_numel(torch.empty(0, 4), 2) == 0
    assert padding.rows_per_rank(7, 4) == len(torch.empty(7).chunk(4)[0])  # torch.chunk's chunk size
    assert padding.rows_per_rank(8, 4) == 2


def test_text_table_aligns_columns_to_their_widest_cell():
    text = text_table.render(("name", "n"), [("a", 1), ("longer", 1234)], align="<>")
    assert text.splitlines() == ["name       n", "a          1", "longer  1234"]
    assert text_table.render(None, [("x", "y")], gap=1) == "x y"
    assert text_table.render(("a", "b"), [], align="^") == "a  b"
