"""The step plan's search (``step_plan.plan_step``) runs on plain values for speed; these tests hold it to the
straightforward search it replaced (kept below as ``_reference_plan_step``: one frozen ``_State`` per schedule, a
dict and a sort per bucket update, every kept key scanned for dominance), bit for bit, on random steps with
one-level and pipelined options, host issue, one or two dtypes and one or two buckets per dtype."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from owner_reduce.planning import step_plan
from owner_reduce.planning.step_plan import LAST_FLUSH_BOUND, FlushTimes, plan_step


@dataclass(frozen=True)
class _RefState:
    """``step_plan._State`` as it was: the reference's arithmetic, ``max`` calls and all."""

    node: float = 0.0
    rail: float = 0.0
    freed: tuple[tuple[int, tuple[float, ...]], ...] = ()
    host: float = 0.0

    def after(self, option: FlushTimes, dtype: int, per_bucket: int) -> tuple[_RefState, float]:
        ends = dict(self.freed).get(dtype, ())
        free = ends[0] if len(ends) >= per_bucket else 0.0
        host = self.host
        if not option.stages:
            host += sum(option.issue_us)
            end = max(self.node, self.rail, free, host) + option.world_us
            node = rail = end
        else:
            node, rail = max(self.node, free), self.rail
            for k, (node_us, rail_us) in enumerate(option.stages):
                host += option.issue_us[k] if k < len(option.issue_us) else 0.0
                node = max(node, host) + node_us
                rail = max(rail, node) + rail_us
            if option.world_us:
                host += sum(option.issue_us[len(option.stages):])
                end = max(node, rail, host) + option.world_us
                node = rail = end
            else:
                end = rail
        ends = (*ends, end)[-per_bucket:]
        freed = tuple(sorted({**dict(self.freed), dtype: ends}.items()))
        return _RefState(node, rail, freed, host), end

    def key(self) -> tuple[float, ...]:
        return (self.node, self.rail, self.host, *(t for _, ends in self.freed for t in ends))


def _reference_search(options, native, buckets, per_bucket, kept_at_most):  # noqa: ANN001, ANN202
    """The search as it was before it ran on plain values: the picks it ends on."""
    last = len(options) - 1
    states = [(_RefState(), ())]
    for i, flush in enumerate(options):
        grown = []
        for state, picks in states:
            for j, option in enumerate(flush):
                if i == last and j and option.alone_us > LAST_FLUSH_BOUND * native[i].alone_us:
                    continue
                after, _ = state.after(option, buckets[i], per_bucket)
                grown.append((after, (*picks, j)))
        grown.sort(key=lambda sp: (max(sp[0].node, sp[0].rail), sp[0].rail, sp[0].node, sp[1]))
        kept, keys = [], []
        for state, picks in grown:
            key = state.key()
            if any(len(k) == len(key) and all(a <= b for a, b in zip(k, key, strict=True)) for k in keys):
                continue
            kept.append((state, picks))
            keys.append(key)
            if len(kept) == kept_at_most:
                break
        states = kept
    return min(states, key=lambda sp: (max(sp[0].node, sp[0].rail), sp[1]))[1]


def _random_option(rng: random.Random) -> FlushTimes:
    # Coarse values make equal ends (ties, duplicate states) common, the cases the plain search must order alike.
    if rng.random() < 0.3:
        return FlushTimes(world_us=rng.choice([5.0, 10.0, 12.5, 40.0]), issue_us=(rng.choice([0.0, 2.5, 6.4]),))
    stages = tuple((rng.choice([1.0, 2.0, 3.5]), rng.choice([1.0, 4.0, 8.25])) for _ in range(rng.randint(1, 6)))
    issue = tuple(rng.choice([0.0, 1.5, 11.14]) for _ in range(rng.randint(0, len(stages) + 1)))
    world = rng.choice([0.0, 0.0, 3.0])
    return FlushTimes(stages, world, issue if world or len(issue) <= len(stages) else issue[:len(stages)])


@pytest.mark.parametrize("seed", range(200))
def test_the_plain_search_picks_what_the_reference_search_picks(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    kept_at_most = rng.choice([3, 8, 256])
    monkeypatch.setattr(step_plan, "_STATES_KEPT", kept_at_most)
    flushes = rng.randint(1, 10)
    options = [[_random_option(rng) for _ in range(rng.randint(1, 6))] for _ in range(flushes)]
    native = [FlushTimes(world_us=rng.choice([20.0, 60.0, 200.0])) for _ in range(flushes)]
    buckets = [rng.choice([0, 0, 1]) if seed % 2 else 0 for _ in range(flushes)]
    per_bucket = rng.choice([1, 2])
    plan = plan_step(options, native, buckets, per_bucket)
    # The steps after the search are unchanged: the alone bound, then the fallback when the search missed native.
    picks = step_plan._alone_bound(options, native, buckets, per_bucket,
                                   _reference_search(options, native, buckets, per_bucket, kept_at_most))
    steps = step_plan.schedule([options[i][j] for i, j in enumerate(picks)], buckets, per_bucket)
    if max((s.end for s in steps), default=0.0) > step_plan.native_step_us(native):
        picks = (0,) * flushes
    assert plan.picks == picks
    for option in (o for flush in options for o in flush):
        for dtype in (0, 1):
            for freed in ((), ((0, (3.0,)),), ((0, (1.0, 9.0)), (1, (2.0, 4.0))), ((1, (30.0, 50.0)),)):
                state = step_plan._State(2.0, 7.5, freed, 1.0)
                new, step = state.after(option, dtype, per_bucket)
                ref, end = _RefState(2.0, 7.5, freed, 1.0).after(option, dtype, per_bucket)
                assert (new.node, new.rail, new.freed, new.host, step.end) == (ref.node, ref.rail, ref.freed,
                                                                                  ref.host, end)
