"""Ranks per node from the host names every rank reported, checked against the launcher's and SLURM's variables
(``planning.nodes``); and the runtime's agreement deciding it on in-process ranks that really exchange their host
names (``ExchangeWorld``). Pure but for the last two tests."""

from __future__ import annotations

import pytest

from owner_reduce.planning.nodes import (
    HOST_INTS,
    LAUNCHER_VARS,
    SLURM_VARS,
    node_layout,
    pack_host,
    slurm_tasks_on_node,
    unpack_host,
)
from tests.support.fakes import ExchangeWorld, flat_map, mirror_runtime

LWS = LAUNCHER_VARS.index("LOCAL_WORLD_SIZE")
STEP = SLURM_VARS.index("SLURM_STEP_TASKS_PER_NODE")


def _hosts(nodes: int, per_node: int) -> list[str]:
    return [f"gpu-node-{r // per_node:02d}" for r in range(nodes * per_node)]


def test_the_hosts_give_the_nodes_and_a_variable_that_agrees_is_named_as_the_source():
    layout = node_layout(_hosts(64, 8), [(LWS, 8)] * 512)
    assert (layout.nodes, layout.ranks_per_node, layout.even, layout.warnings) == (64, 8, True, ())
    assert layout.describe() == "64 nodes x 8 (host names = LOCAL_WORLD_SIZE)"
    both = node_layout(_hosts(2, 4), [(LWS, 4)] * 8, [(STEP, 4)] * 8)
    assert both.describe() == "2 nodes x 4 (host names = LOCAL_WORLD_SIZE = SLURM_STEP_TASKS_PER_NODE)"


def test_a_bare_srun_with_one_gpu_per_task_counts_the_hosts():
    """No LOCAL_WORLD_SIZE, each rank sees one GPU: before, every rank was its own node and the two-level flush was
    off. The hosts say 4 nodes of 8, and SLURM's step list agrees."""
    hosts = _hosts(4, 8)
    assert node_layout(hosts).describe() == "4 nodes x 8 (host names)"
    slurm = [(STEP, slurm_tasks_on_node("8(x4)", r // 8)) for r in range(32)]
    assert node_layout(hosts, [(-1, 0)] * 32, slurm).describe() == ("4 nodes x 8 (host names = "
                                                                   "SLURM_STEP_TASKS_PER_NODE)")


def test_a_variable_that_disagrees_with_the_hosts_is_a_warning_naming_both():
    """Two launches on one 8-GPU host, each torchrun with LOCAL_WORLD_SIZE=4: the ranks share one NVLink domain."""
    layout = node_layout(["box"] * 8, [(LWS, 4)] * 8)
    assert (layout.nodes, layout.ranks_per_node) == (1, 8)
    (warning,) = layout.warnings
    assert warning == ("owner_reduce: ranks per node: the host names give 8 ranks on each of 1 host, but "
                       "LOCAL_WORLD_SIZE=4 on ranks 0-7; the host names' count is used (ranks on one host share its "
                       "NVLink whatever a variable says)")
    assert layout.describe() == "1 node x 8 (host names, not the variables)"
    # Only the ranks whose variable is wrong are named, grouped by what it says.
    mixed = node_layout(_hosts(2, 4), [(LWS, 4)] * 6 + [(LWS, 2)] * 2, [(STEP, 4)] * 8)
    (warning,) = mixed.warnings
    assert "but LOCAL_WORLD_SIZE=2 on ranks 6, 7;" in warning
    assert mixed.describe() == "2 nodes x 4 (host names = SLURM_STEP_TASKS_PER_NODE)"


def test_negative_control_the_same_counts_give_no_warning():
    """The check reads each rank's own host: a variable right for every rank is never named."""
    assert node_layout(_hosts(3, 2), [(LWS, 2)] * 6, [(STEP, 2)] * 6).warnings == ()
    assert node_layout(["a", "a", "b"], [(LWS, 2), (LWS, 2), (LWS, 1)]).warnings == ()  # uneven, and it says so


def test_uneven_hosts_are_described_as_such():
    layout = node_layout(["a", "a", "a", "b"])
    assert (layout.even, layout.ranks_per_node, layout.describe()) == (False, 3, "2 nodes x 1-3 ranks (host names)")


@pytest.mark.parametrize(("spec", "node", "tasks"), [
    ("8(x64)", 0, 8), ("8(x64)", 63, 8), ("8(x64)", 64, 0), ("4,2", 1, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1),
    ("", 0, 0), ("x(4)", 0, 0), ("4(x)", 0, 0)])
def test_slurms_tasks_per_node_lists_are_read_at_the_nodes_index(spec, node, tasks):
    assert slurm_tasks_on_node(spec, node) == tasks


def test_host_names_travel_as_integers():
    for name in ("gpu-node-03", "h\u00f4te.example.org", "", "x" * 64):
        packed = pack_host(name)
        assert len(packed) == HOST_INTS and all(-2**63 <= v < 2**63 for v in packed)
        assert unpack_host(packed) == name
    assert unpack_host(pack_host("y" * 80)) == "y" * 64  # cut at Linux's limit


@pytest.mark.timeout(60)
def test_the_runtime_counts_ranks_per_node_from_the_hosts_it_gathered(monkeypatch):
    """Four in-process ranks on two hosts that really exchange their agreement rows, with no LOCAL_WORLD_SIZE (a bare
    srun): the runtime's layout and topology say two nodes of two, and every rank knows every rank's host."""
    from owner_reduce.runtime import agreement
    from tests.support.fakes import exchange_thread_rank

    monkeypatch.setattr(agreement, "host_name", lambda: f"gpu-node-{exchange_thread_rank() // 2:02d}")
    monkeypatch.setattr(agreement, "launcher_ranks_per_node", lambda environ=None: (-1, 0))
    runtimes = _init(monkeypatch)
    for rt in runtimes:
        assert rt.hosts == ["gpu-node-00", "gpu-node-00", "gpu-node-01", "gpu-node-01"]
        assert rt.node_layout.describe() == "2 nodes x 2 (host names)"
        assert rt.flusher.cost.topology.gpus_per_node == 2
    assert runtimes[0].stats.settings_line.endswith(
        "4 ranks = 2 nodes x 2 (host names), bucket 64 elements, owner_reduce 0.1.0")


@pytest.mark.timeout(60)
def test_negative_control_a_launcher_that_says_otherwise_is_warned_about_on_rank_0(monkeypatch):
    from deepspeed.utils import logger

    from owner_reduce.runtime import agreement
    from tests.support.fakes import exchange_thread_rank

    monkeypatch.setattr(agreement, "host_name", lambda: "one-host")
    monkeypatch.setattr(agreement, "launcher_ranks_per_node", lambda environ=None: (LWS, 2))
    warnings: list[tuple[int, str]] = []
    monkeypatch.setattr(logger, "warning", lambda message: warnings.append((exchange_thread_rank(), message)))
    runtimes = _init(monkeypatch)
    assert all(rt.node_layout.describe() == "1 node x 4 (host names, not the variables)" for rt in runtimes)
    assert [rank for rank, w in warnings if "ranks per node" in w] == [0]
    assert runtimes[0].flusher.cost.topology.gpus_per_node == 4  # the hosts', not the variable's


def _init(monkeypatch) -> list:
    world = ExchangeWorld(4, timeout_s=10.0)
    owner_map = flat_map([40] * 6, 4)
    return [rt for rt, _ in world.run(lambda rank: mirror_runtime(owner_map, rank=rank, comm=world.comm(rank),
                                                                  bucket=64))]
