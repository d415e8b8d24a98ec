"""The network model's time per collective, written out by hand against its conventions: sizes as
each rank's input tensor, bus bandwidth in nccl-tests' sense, latency per step; its presets, the
overrides a command line passes and the record of a network's parameters."""

from __future__ import annotations

import json

import pytest

from zpp_compile.runtime.network_model import (
    OPS,
    Link,
    Network,
    collective_seconds,
    network_from_preset,
    with_overrides,
)

MiB = 2**20
NVLINK = Link(latency_s=2e-6, busbw_bytes_per_s=245e9, op_factors={"reduce_scatter": 229 / 245})
NIC = Link(latency_s=5e-6, busbw_bytes_per_s=45e9)
NODES_OF_8 = Network(8, NVLINK, NIC)
NODES_OF_4 = Network(4, NVLINK, NIC)


def test_a_group_inside_a_node_runs_on_the_intra_node_link():
    one_node = range(8)
    # all-gather of a 64 MiB shard: S = 8 x 64 MiB, (n-1)/n of it over the link, 7 ring steps.
    assert collective_seconds(NODES_OF_8, "all_gather", one_node, 64 * MiB) == pytest.approx(
        7 * 2e-6 + 7 / 8 * 8 * 64 * MiB / 245e9)
    # reduce-scatter of a 512 MiB input at its own factor: 229 GB/s.
    assert collective_seconds(NODES_OF_8, "reduce_scatter", one_node, 512 * MiB) == pytest.approx(
        7 * 2e-6 + 7 / 8 * 512 * MiB / 229e9)
    # all-reduce: two ring passes, 2(n-1)/n of S; the tree is a chain inside a node, never faster.
    assert collective_seconds(NODES_OF_8, "all_reduce", one_node, 512 * MiB) == pytest.approx(
        14 * 2e-6 + 2 * 7 / 8 * 512 * MiB / 245e9)
    assert collective_seconds(NODES_OF_8, "all_to_all", one_node, 512 * MiB) == pytest.approx(
        7 * 2e-6 + 7 / 8 * 512 * MiB / 245e9)
    # broadcast: a pipelined ring of 7 steps, factor 1.
    assert collective_seconds(NODES_OF_8, "broadcast", one_node, 512 * MiB) == pytest.approx(
        7 * 2e-6 + 512 * MiB / 245e9)


def test_hpz_secondary_group_is_four_consecutive_ranks_inside_a_node():
    secondary = (4, 5, 6, 7)  # on node 0 of nodes of 8
    assert collective_seconds(NODES_OF_8, "all_gather", secondary, 64 * MiB) == pytest.approx(
        3 * 2e-6 + 3 / 4 * 4 * 64 * MiB / 245e9)


def test_a_group_across_two_nodes_of_four_spreads_its_rings_over_the_members_nics():
    world = range(8)  # 2 nodes x 4
    size = 8 * 64 * MiB
    # A ring pass: 6 steps inside nodes, 1 into the other node. Each GPU sends 1/4 of the bus
    # bytes through its NIC (4 x 45 GB/s for the node) and 3/4 over NVLink, at once.
    bus = 7 / 8 * size
    assert bus / (4 * 45e9) > bus * 3 / 4 / 245e9  # the network is the bottleneck here
    assert collective_seconds(NODES_OF_4, "all_gather", world, 64 * MiB) == pytest.approx(
        6 * 2e-6 + 1 * 5e-6 + bus / (4 * 45e9))
    # all-to-all: no ring; 4 of a rank's 8 chunks leave the node through its own NIC, 3 stay.
    assert collective_seconds(NODES_OF_4, "all_to_all", world, size) == pytest.approx(
        3 * 2e-6 + 4 * 5e-6 + max(size * 4 / 8 / 45e9, size * 3 / 8 / 245e9))
    # all-reduce of 1 GiB: the ring (two passes) beats the tree (2 S at 0.92 of the bandwidth).
    ring = 2 * (6 * 2e-6 + 5e-6) + 2 * 7 / 8 * 1024 * MiB / (4 * 45e9)
    tree = 2 * (3 * 2e-6 + 1 * 5e-6) + 2 * 1024 * MiB / 0.92 / (4 * 45e9)
    assert ring < tree
    assert collective_seconds(NODES_OF_4, "all_reduce", world, 1024 * MiB) == pytest.approx(ring)


def test_qgz_inter_node_hop_holds_one_rank_per_node():
    local_index_1 = (1, 5, 9, 13)  # 4 nodes of 4
    # Every step crosses nodes, at the per-GPU inter-node bandwidth: nothing is inside a node.
    assert collective_seconds(NODES_OF_4, "all_to_all", local_index_1, 32 * MiB) == pytest.approx(
        3 * 5e-6 + 3 / 4 * 32 * MiB / 45e9)
    assert collective_seconds(NODES_OF_4, "all_gather", local_index_1, 8 * MiB) == pytest.approx(
        3 * 5e-6 + 3 / 4 * 4 * 8 * MiB / 45e9)


def test_a_group_of_one_or_no_bytes_takes_no_time():
    for op in OPS:
        assert collective_seconds(NODES_OF_8, op, (3,), 64 * MiB) == 0.0
        assert collective_seconds(NODES_OF_8, op, range(16), 0) == 0.0


def test_a_small_all_reduce_takes_the_tree_a_large_one_the_ring():
    one_per_node = range(0, 16 * 8, 8)  # 16 nodes, local index 0
    small, large = 1 * MiB, 1024 * MiB
    # Tree: 2 log2(16) network steps, 2 S at 0.92 of the bus bandwidth. Ring: 2 x 15 steps, 2(n-1)/n S.
    tree_small = 2 * 4 * 5e-6 + 2 * small / 0.92 / 45e9
    ring_small = 2 * 15 * 5e-6 + 2 * 15 / 16 * small / 45e9
    assert tree_small < ring_small
    assert collective_seconds(NODES_OF_8, "all_reduce", one_per_node, small) == pytest.approx(tree_small)
    ring_large = 2 * 15 * 5e-6 + 2 * 15 / 16 * large / 45e9
    assert ring_large < 2 * 4 * 5e-6 + 2 * large / 0.92 / 45e9
    assert collective_seconds(NODES_OF_8, "all_reduce", one_per_node, large) == pytest.approx(ring_large)


def test_nodes_sharing_one_fabric_time_every_group_on_it():
    one_host = Network(2, NVLINK, None)  # 2 emulated nodes of 2 on one NVLink host
    assert collective_seconds(one_host, "all_gather", range(4), 64 * MiB) == pytest.approx(
        3 * 2e-6 + 3 / 4 * 4 * 64 * MiB / 245e9)


def test_bad_ops_and_groups_are_refused():
    with pytest.raises(ValueError, match="unknown collective 'gather'.*all_gather"):
        collective_seconds(NODES_OF_8, "gather", range(2), 1)
    with pytest.raises(ValueError, match="distinct ranks"):
        collective_seconds(NODES_OF_8, "all_gather", (0, 0), 1)


def test_presets_carry_their_cited_figures():
    slow = network_from_preset("slow-link", 1)
    assert slow.inter_node.bandwidth("all_gather") == pytest.approx(4.2e9)
    assert slow.inter_node.bandwidth("reduce_scatter") == pytest.approx(4.3e9)
    assert slow.inter_node.bandwidth("all_to_all") == pytest.approx(2.7e9)
    nvlink = network_from_preset("nvlink-h100", 8)
    assert nvlink.inter_node is None
    assert [nvlink.intra_node.bandwidth(op) / 1e9 for op in OPS] == pytest.approx([245, 229, 329, 283, 245])
    for rate in (100, 200, 400, 800):
        assert network_from_preset(f"ib-{rate}g", 8).inter_node.bandwidth("all_gather") == pytest.approx(
            rate * 1e9 / 8 * 0.9)


def test_overrides_replace_parameters_as_a_command_line_passes_them():
    network = network_from_preset("ib-400g", 8, "inter_busbw_gbyte_per_s=25, inter_latency_us=8,"
                                               "inter_all_to_all_factor=0.5")
    assert network.inter_node.latency_s == pytest.approx(8e-6)
    assert network.inter_node.bandwidth("all_gather") == pytest.approx(25e9)
    assert network.inter_node.bandwidth("all_to_all") == pytest.approx(12.5e9)
    assert network.intra_node.bandwidth("all_gather") == pytest.approx(245e9)
    assert network_from_preset("ib-400g", 8, "").to_dict() == pytest.approx(network_from_preset("ib-400g", 8).to_dict())


def test_override_errors_name_what_is_allowed():
    with pytest.raises(ValueError, match="unknown network preset 'ib-1t'; presets: nvlink-h100, .*slow-link"):
        network_from_preset("ib-1t", 8)
    with pytest.raises(ValueError, match="unknown network override 'inter_bandwidth'; allowed: intra_latency_us,"):
        network_from_preset("ib-400g", 8, "inter_bandwidth=200")
    with pytest.raises(ValueError, match="no inter-node link\\); allowed: intra_latency_us.*intra_broadcast_factor$"):
        network_from_preset("nvlink-h200", 8, "inter_latency_us=8")
    with pytest.raises(ValueError, match="'inter_latency_us' needs a number, got 'fast'"):
        network_from_preset("ib-400g", 8, "inter_latency_us=fast")
    with pytest.raises(ValueError, match="bandwidth and factors > 0"):
        network_from_preset("ib-400g", 8, "inter_busbw_gbyte_per_s=0")


def test_to_dict_records_every_parameter_with_its_unit():
    record = network_from_preset("ib-200g", 4).to_dict()
    link_keys = ["latency_us", "busbw_gbyte_per_s", *(f"{op}_factor" for op in OPS)]
    assert list(record) == ["ranks_per_node", *(f"{side}_{key}" for side in ("intra", "inter") for key in link_keys)]
    assert record["ranks_per_node"] == 4
    assert record["inter_latency_us"] == pytest.approx(5.0)
    assert record["inter_busbw_gbyte_per_s"] == pytest.approx(200 / 8 * 0.9)
    assert json.loads(json.dumps(record)) == record
    assert with_overrides(network_from_preset("nvlink-h200", 2), "").to_dict()["inter_latency_us"] is None
