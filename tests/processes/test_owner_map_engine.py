"""The owner map of real DeepSpeed ZeRO-1 engines on gloo ranks, checked against the optimizer itself."""

import dataclasses
import functools

import pytest

from harness.launch import run_ranks
from owner_reduce.planning.owner_map import OwnerMap, ParamSlice, Placement


def _tamper(owner_map: OwnerMap, how: str) -> OwnerMap:
    """A deliberately wrong map: the negative control for the agreement check."""
    placements = list(owner_map)
    ws = owner_map.dp_world_size
    for i, p in enumerate(placements):
        if how == "wrong_owner" and p.placement is Placement.ONE_OWNER and p.numel:
            (s,) = p.slices
            placements[i] = dataclasses.replace(p, slices=(ParamSlice(s.offset, s.length, (s.owner + 1) % ws),))
            break
        if how == "shifted_boundary" and p.placement is Placement.STRADDLES:
            a, b, *rest = p.slices
            placements[i] = dataclasses.replace(
                p, slices=(ParamSlice(a.offset, a.length + 1, a.owner), ParamSlice(b.offset + 1, b.length - 1, b.owner),
                           *rest))
            break
    else:
        raise AssertionError(f"no parameter to tamper with ({how})")
    return OwnerMap(placements, ws)


def _map_worker(rank, world_size, two_groups):
    import deepspeed.comm as dist

    from owner_reduce.wiring.engine_tables import build_owner_map, disagreements_with_optimizer
    from tests.support.zero1_engines import odd_mlp_engine

    engine = odd_mlp_engine(two_groups=two_groups, empty_param=True)
    opt = engine.optimizer
    m = build_owner_map(engine)
    # Independent of disagreements_with_optimizer: membership straight from the optimizer's flag.
    membership = {pid: (any(s.owner == rank for s in m.slices(pid)), bool(opt.is_param_in_current_partition[pid]))
                  for pid in opt.param_dict}
    digests = [None] * world_size
    dist.all_gather_object(digests, m.digest())  # the one tiny collective ranks can use to verify agreement
    return {
        "summary": m.summary(),
        "digests": digests,
        "placements": [(p.param_id, p.numel, p.placement.value, p.slices) for p in m],
        "membership": membership,
        "problems": disagreements_with_optimizer(m, engine),
        "tampered": {how: disagreements_with_optimizer(_tamper(m, how), engine)
                     for how in ("wrong_owner", "shifted_boundary")},
        "empty_param_mapped": engine.module.empty in m,
        "n_groups": len(opt.bit16_groups),
    }


@functools.cache
def _maps(world_size: int, two_groups: bool) -> list[dict]:
    """``_map_worker``'s results by rank, launched once per session (the negative control reads the ws-2 two-group
    engine's tampered maps from the launch its agreement test made)."""
    return run_ranks(_map_worker, world_size, args=(two_groups,), timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("two_groups", [True, False])
def test_map_agrees_with_optimizer_on_every_rank(world_size, two_groups):
    results = _maps(world_size, two_groups)
    first = results[0]
    assert first["n_groups"] == (2 if two_groups else 1)
    for rank, r in enumerate(results):
        assert r["problems"] == [], f"rank {rank}: {r['problems']}"
        assert all(mine == theirs for mine, theirs in r["membership"].values()), r["membership"]
        assert len(set(r["digests"])) == 1, "ranks disagree on the owner map"
        assert r["placements"] == first["placements"] and r["summary"] == first["summary"]
        # DeepSpeed leaves zero-element parameters out of its optimizer; so does the map.
        assert not r["empty_param_mapped"]
    kinds = [kind for _, _, kind, _ in first["placements"]]
    assert "straddles" in kinds and "one_owner" in kinds, "the model must have partition boundaries inside params"
    n_one = kinds.count("one_owner")
    assert first["summary"] == f"DeepCompile reduce_to_owner: {n_one}/{len(kinds)} gradients reduce to one rank"
    # Every element is kept by exactly one rank.
    for _, numel, _, slices in first["placements"]:
        assert sum(s.length for s in slices) == numel


@pytest.mark.timeout(240)
def test_negative_control_wrong_maps_are_caught():
    results = _maps(2, True)
    for how in ("wrong_owner", "shifted_boundary"):
        assert any(r["tampered"][how] for r in results), f"a {how} map went unnoticed"


def _moe_worker(rank, world_size):
    import deepspeed
    import torch

    from owner_reduce.wiring.engine_tables import build_owner_map, disagreements_with_optimizer

    class MoEModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(8, 16)
            self.moe = deepspeed.moe.layer.MoE(hidden_size=16, expert=torch.nn.Linear(16, 16), num_experts=2,
                                               ep_size=world_size, k=1)
            self.out = torch.nn.Linear(16, 3)

        def forward(self, x):
            h, _, _ = self.moe(self.inp(x))
            return self.out(h)

    torch.manual_seed(0)
    model = MoEModel()
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    optimizer = torch.optim.Adam(groups, lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    m = build_owner_map(engine)
    expert_ids = {engine.optimizer.get_param_id(p) for n, p in model.named_parameters() if "experts" in n}
    return {
        "expert": {pid: (m.placement(pid).placement.value, m.owner(pid)) for pid in expert_ids},
        "dense": [m.placement(engine.optimizer.get_param_id(p)).placement.value
                  for n, p in model.named_parameters() if "experts" not in n],
        "problems": disagreements_with_optimizer(m, engine),
        "summary": m.summary(),
    }


@pytest.mark.timeout(240)
def test_moe_expert_groups_are_allreduce():
    results = run_ranks(_moe_worker, 2, timeout=200)
    for r in results:
        assert r["expert"] and all(kind == "other_comm" and owner is None for kind, owner in r["expert"].values())
        assert r["dense"] and "other_comm" not in r["dense"]
        assert r["problems"] == []


def _round_robin_worker(rank, world_size):
    import deepspeed
    import torch

    from harness.toy_models import OddMLP
    from owner_reduce.wiring.engine_tables import build_owner_map, disagreements_with_optimizer

    torch.manual_seed(0)
    model = OddMLP()
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1, "round_robin_gradients": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return disagreements_with_optimizer(build_owner_map(engine), engine)


@pytest.mark.timeout(240)
def test_round_robin_partition_order_is_refused():
    """round_robin_gradients reorders ZeRO's partitions; DeepCompile pairs grad buffers in parameter order."""
    problems = run_ranks(_round_robin_worker, 2, timeout=200)
    assert any("round_robin_gradients" in p for rank_problems in problems for p in rank_problems), problems
