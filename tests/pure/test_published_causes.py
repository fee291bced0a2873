"""NCCL 2.30's plan of one group (``research.nccl_plan``) and the published check's candidate causes
(``research.published_causes``), as pure logic on hand-made groups whose answers follow from enqueue.cc by hand."""

from __future__ import annotations

import pytest

from owner_reduce.planning import collective_time as ct
from research.nccl_plan import WORKS_PER_BATCH, channel_time_us, plan_group
from research.published_causes import Case, costed, format_causes

pytestmark = pytest.mark.timeout(60)
A800 = ct.A800_NODE  # 16 communicator channels


def test_small_calls_share_the_first_channel_and_large_ones_fill_the_rest():
    """Continuous byte distribution (enqueue.cc 664-738): the budget per channel is the group's traffic over 16
    channels, the tasks in ascending size; 100 calls of 2 KiB take one 32 KiB cell each and fit channel 0's budget."""
    calls = [(ct.ALLREDUCE, 2048)] * 100 + [(ct.ALLREDUCE, 8 << 20)] * 16
    plan = plan_group(calls, A800)
    assert plan.plans == 1 and len(plan.tasks) == 116
    assert sum(1 for w in plan.channels[0] if w.nbytes == 2048) == 100
    assert all(w.nbytes > 2048 for c in plan.channels[1:] for w in c)
    assert sum(w.nbytes for c in plan.channels for w in c) == sum(n for _, n in calls)  # every byte placed once
    assert plan.busiest == len(plan.channels[0]) > 100


def test_a_large_call_spans_channels_from_the_current_one():
    (task,), plan = [(ct.ALLREDUCE, 64 << 20)], None
    plan = plan_group([task], A800)
    assert [len(c) for c in plan.channels] == [1] * 16  # its traffic is the whole budget: every channel a part
    assert sum(w.nbytes for c in plan.channels for w in c) == 64 << 20


def test_the_kernel_arguments_bound_the_work_batches_and_a_second_kernel_starts():
    """254 batches of 16 bytes fit 4,064 bytes of arguments; a batch holds 8 works of one aggregate on one channel.
    Alone, tiny calls spread over the 16 channels (each counts 32 KiB of traffic): 1,000 take about 8 batches a channel,
    one kernel; 2,100 take 17 per channel, more than 254 in all, so a second plan (kernel launch) takes the rest."""
    assert WORKS_PER_BATCH == 8
    one = plan_group([(ct.ALLREDUCE, 2048)] * 1000, A800)
    assert one.plans == 1 and 120 <= one.batches <= 254 and 60 <= one.busiest <= 64
    two = plan_group([(ct.ALLREDUCE, 2048)] * 2100, A800)
    assert two.plans == 2 and two.works == 2100
    with pytest.raises(ValueError, match="AllReduce and Reduce"):
        plan_group([(ct.REDUCE_SCATTER, 4096)], A800)


def test_channel_time_charges_each_channel_its_own_works_in_turn():
    calls = [(ct.ALLREDUCE, 2048)] * 100 + [(ct.ALLREDUCE, 8 << 20)] * 16
    plan = plan_group(calls, A800)
    serial = channel_time_us(plan, A800)
    tuner = ct.group_time_us(calls, A800, physical=False)  # assumes the 116 tasks spread evenly: 8 per channel
    assert serial > tuner  # the 100 small works run one after another on channel 0
    assert channel_time_us(plan, A800, 10.0) == pytest.approx(serial + 10.0 * plan.busiest, rel=0.05)


def test_each_cause_is_costed_on_both_cases_and_only_fitted_constants_close_them():
    small = [(ct.ALLREDUCE, 2048)] * 150
    big = [(ct.ALLREDUCE, 4 << 20)] * 50
    owner = [(ct.REDUCE, n) for _, n in small + big]
    cases = [Case("AllReduce", tuple(small + big), 0.0, ct.group_time_us(small + big, A800, physical=False) / 1e3),
             Case("owner", tuple(owner), 0.0, ct.group_time_us(owner, A800, physical=False) / 1e3)]
    cases = [Case(c.name, c.calls, 2 * c.model_ms, c.model_ms) for c in cases]  # "measured": twice the model
    causes = costed(cases, A800)
    assert causes.calls == (200, 200) and causes.host_native_ms == (cases[0].model_ms, cases[1].model_ms)
    for needed, case in zip(causes.per_call_needed_us, cases, strict=True):
        assert case.model_ms + needed * 200 / 1000 == pytest.approx(case.measured_ms)
    assert causes.small_calls == (150, 150) and 0 < causes.small_share[0] < 0.01
    assert all(a >= s for a, s in zip(causes.all_alone_ms, causes.small_alone_ms, strict=True))
    for needed, plan_ms in zip(causes.per_work_needed_us, causes.channel_ms, strict=True):
        assert needed > 0 and plan_ms > 0
    text = "\n".join(format_causes(causes, cases))
    assert "(a) host issue per call" in text and "(b) NCCL 2.30's plan" in text and "(c) small-call bandwidth" in text
