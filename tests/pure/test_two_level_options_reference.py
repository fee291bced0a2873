"""``TwoLevel.options`` costs each stage count's ReduceScatter and tail stages once and builds only the winning
option (speed); these tests hold it to the loop it replaced (``_reference_best_option`` below: an option built and
costed per count of leading ReduceScatter stages, the padding bound summed for each), option for option, on random
flushes of 2-4 nodes, by owner and balanced, both rail steps, with and without host issue and a padding bound."""

from __future__ import annotations

import random

import pytest

from owner_reduce.planning import two_level
from owner_reduce.planning.alignment import align_elems
from owner_reduce.planning.collective_time import topology_of
from owner_reduce.planning.host_cost import DEFAULT, NONE
from owner_reduce.planning.two_level import (
    BALANCED,
    BY_OWNER,
    RAIL_REDUCE,
    TwoLevelGeometry,
    TwoLevelOption,
    _stage_issue,
    _with_handoff,
    two_level_of,
)


def _reference_best_option(levels, step, blocks, lengths, width, stages, dtype_bytes, max_padding,  # noqa: ANN001
                           balanced=None, host=NONE):  # noqa: ANN001, ANN202
    """``TwoLevel._best_option`` as it was."""
    node_rs, node_tail, rail_us, rail_issue = levels._stage_costs(step, blocks, lengths, width, stages, dtype_bytes)
    handoff = levels._node_handoff_us(balanced, width, stages, dtype_bytes) if balanced is not None else None
    layout = BY_OWNER if balanced is None else BALANCED
    best = None
    for scattered in (range(stages, -1, -1) if step == RAIL_REDUCE else (stages,)):
        if max_padding is not None and sum(max(0, scattered * width - n) for n in lengths) > max_padding:
            continue
        stage_us = _with_handoff([(node_rs if stage < scattered else node_tail[stage], rail_us[stage])
                                  for stage in range(stages)], handoff[0] if handoff else None)
        geometry = TwoLevelGeometry(levels.ranks_per_node, stages, width, scattered, tuple(lengths),
                                    align_elems(dtype_bytes))
        option = TwoLevelOption(geometry, step, stage_us, layout,
                                _stage_issue(host, geometry, rail_issue, handoff[1] if handoff else None))
        if best is None or option.alone_us < best.alone_us:
            best = option
    return best


@pytest.mark.parametrize("seed", range(60))
def test_options_are_the_reference_loops_options(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    per_node, nodes = rng.choice([(4, 2), (8, 2), (8, 3), (4, 4)])
    levels = two_level_of(topology_of(per_node * nodes, per_node, rng.choice(["hopper", "ampere"])), per_node)
    assert levels is not None
    owners = rng.randint(1, per_node * nodes)
    first = rng.randrange(per_node * nodes - owners + 1)
    sizes = [0] * (per_node * nodes)
    for rank in range(first, first + owners):
        sizes[rank] = rng.choice([0, 1, 7, 100, 4096, 70_001, 1_000_000, rng.randint(1, 3_000_000)])
    if not any(sizes):
        sizes[first] = 12_345
    dtype_bytes = rng.choice([2, 4])
    max_padding = rng.choice([None, 0, sum(sizes) // 8, sum(sizes) // 100])
    host = rng.choice([NONE, DEFAULT])
    got = levels.options(sizes, dtype_bytes, max_padding, host=host)
    monkeypatch.setattr(two_level.TwoLevel, "_best_option", _reference_best_option)
    assert got == levels.options(sizes, dtype_bytes, max_padding, host=host)
