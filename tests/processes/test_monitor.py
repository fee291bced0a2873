"""DeepSpeed's monitor: every ``steps_per_print`` steps rank 0 writes the step's reduction span, exposed time and bytes
saved as min / median / max over ranks, after one small exchange at that step and none in between
(``planning.monitor``, ``runtime.monitor``). Pure, in process on ranks that really exchange (``ExchangeWorld``), and
DeepSpeed's CSV monitor on two gloo ranks, its files read back, with the negative control of a runtime that measures
every step."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from harness.launch import run_ranks
from harness.toy_training import TrainSpec, ds_config, train_each
from owner_reduce.planning.monitor import EVENT_PREFIX, UNMEASURED, due, event_names, monitor_events, pack_row
from owner_reduce.runtime.monitor import MonitorSink
from tests.support.fakes import ExchangeWorld, flat_map, mirror_runtime

NUMELS = [24, 40, 16, 56, 8, 32]


def test_the_events_are_min_median_max_over_the_ranks_that_measured():
    rows = [pack_row(3000.0, 1000.0, 400), pack_row(5000.0, 0.0, 0), pack_row(None, None, 800)]
    events = dict((name, value) for name, value, _ in monitor_events(rows, 48))
    assert events[f"{EVENT_PREFIX}reduction_span_ms_min"] == pytest.approx(3.0)
    assert events[f"{EVENT_PREFIX}reduction_span_ms_median"] == pytest.approx(4.0)  # rank 2 did not measure
    assert events[f"{EVENT_PREFIX}exposed_ms_max"] == pytest.approx(1.0)
    assert [events[f"{EVENT_PREFIX}bytes_saved_{s}"] for s in ("min", "median", "max")] == [0, 400, 800]
    assert {x for _, _, x in monitor_events(rows, 48)} == {48} and len(events) == len(event_names()) == 9
    assert [n for n, _, _ in monitor_events([pack_row(None, None, 0)], 1)] == event_names()[6:]  # bytes only
    assert pack_row(None, 2.0, 5) == [UNMEASURED, 2000, 5]
    assert [s for s in range(10) if due(s, 4)] == [3, 7] and not any(due(s, 0) for s in range(10))


def _world_with_monitor(every: int, steps: int) -> tuple[list, list[list], list[int]]:
    """Three in-process ranks with a monitor every ``every`` steps: the runtimes, what rank 0 wrote per call, and every
    rank's count of ``all_gather_ints`` calls after init."""
    world = ExchangeWorld(3, timeout_s=10.0)
    owner_map = flat_map(NUMELS, 3)
    written: list[list] = []
    done = [0] * 3

    def rank_main(rank: int):
        rt, comm = mirror_runtime(owner_map, rank=rank, comm=world.comm(rank), bucket=64)
        rt.monitor = MonitorSink(write=written.append, every=every, steps_done=lambda: done[rank],
                                 x=lambda: 6 * (done[rank] + 1))
        gathers = [0]
        original = comm.all_gather_ints

        def counted(values):
            gathers[0] += 1
            return original(values)

        comm.all_gather_ints = counted
        grads = {pid: torch.arange(1.0, n + 1) for pid, n in enumerate(NUMELS)}
        for _ in range(steps):
            rt.start_backward(True)
            for pid in reversed(range(len(NUMELS))):
                rt.reduce_grad(grads[pid], 11, pid)
            rt.end_backward(11, False)
            done[rank] += 1  # engine.step()
        return rt, gathers[0]

    results = world.run(rank_main)
    return [rt for rt, _ in results], written, [g for _, g in results]


@pytest.mark.timeout(60)
def test_every_nth_step_one_exchange_and_rank_0_writes_it():
    runtimes, written, gathers = _world_with_monitor(every=2, steps=5)
    assert [rt.stats.monitor_steps for rt in runtimes] == [2, 2, 2]  # steps 2 and 4
    assert gathers == [2, 2, 2], "one gather per measured step, none in between"
    assert len(written) == 2 and [{x for _, _, x in events} for events in written] == [{12}, {24}]
    for events in written:
        values = {name: value for name, value, _ in events}
        assert [n for n, _, _ in events] == event_names()
        for metric in ("reduction_span_ms", "exposed_ms", "bytes_saved"):
            low, mid, high = (values[f"{EVENT_PREFIX}{metric}_{s}"] for s in ("min", "median", "max"))
            assert 0 <= low <= mid <= high, (metric, low, mid, high)
        assert values[f"{EVENT_PREFIX}bytes_saved_max"] > 0  # the owner path: each rank receives its part only
    assert runtimes[0].stats.monitor_events == 18 and runtimes[1].stats.monitor_events == 0  # rank 0 writes


def _read_csv(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every CSV file DeepSpeed's monitor wrote: its event (the file's name), then its (step, value) rows."""
    out = {}
    for path in folder.glob("*.csv"):
        with path.open() as f:
            rows = list(csv.reader(f))
        header, body = rows[0], rows[1:]
        assert header[0] == "step", (path, header)
        out[path.stem] = [(int(step), float(value)) for step, value in body]
    return out


def assert_monitor_csv(folder: Path, steps: list[int]) -> None:
    """Each owner_reduce event's file has one row at each of ``steps`` (DeepSpeed's own sample axis, which its
    ``lr`` rows share), and min <= median <= max at each, exposed within the reduction's span."""
    files = _read_csv(folder)
    lr = [x for x, _ in files["Train_Samples_lr"]]
    for name in event_names():
        rows = files.get(name.replace("/", "_"))
        assert rows is not None, f"no {name} written: {sorted(files)}"
        assert [x for x, _ in rows] == steps, f"{name} written at {[x for x, _ in rows]}, not {steps}"
        assert set(steps) <= set(lr), (steps, lr)
    by = {name: dict(files[name.replace("/", "_")]) for name in event_names()}
    for x in steps:
        for metric in ("reduction_span_ms", "exposed_ms", "bytes_saved"):
            low, mid, high = (by[f"{EVENT_PREFIX}{metric}_{s}"][x] for s in ("min", "median", "max"))
            assert 0 <= low <= mid <= high, (x, metric, low, mid, high)
        assert by[f"{EVENT_PREFIX}exposed_ms_min"][x] <= by[f"{EVENT_PREFIX}reduction_span_ms_min"][x]
        assert by[f"{EVENT_PREFIX}exposed_ms_max"][x] <= by[f"{EVENT_PREFIX}reduction_span_ms_max"][x]
        assert by[f"{EVENT_PREFIX}bytes_saved_max"][x] > 0


@pytest.mark.timeout(300)
def test_deepspeeds_csv_monitor_gets_min_median_max_rows_every_steps_per_print(tmp_path):
    """Two gloo ranks, five steps, ``steps_per_print`` 2, DeepSpeed's CSV monitor: rows at the samples of steps 2 and
    4 (a train batch of 8), read back from the files DeepSpeed wrote; the same run with the runtime measuring every
    step (the negative control) has rows at every step and fails the check; plain ZeRO-1 on the same data trains as
    the monitored run does."""
    base = TrainSpec(steps=5, reduce_probe=False, reduce_bucket_size=400)
    specs = []
    for name, fault in (("monitored", None), ("every_step", "monitor_every_step")):
        config = ds_config(base)
        config["steps_per_print"] = 2
        config["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path), "job_name": name}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        specs.append(dataclasses.replace(base, config_file=str(path), inject_fault=fault, destroy=True))
    plain = dataclasses.replace(base, mode="plain")
    # The faulty run last: its fault stays in the ranks' processes (``harness.faults.inject``).
    by_rank = run_ranks(train_each, 2, args=((specs[0], plain, specs[1]),), timeout=240)
    monitored, reference = [r[0] for r in by_rank], [r[1] for r in by_rank]
    assert [r["losses"] for r in monitored] == [r["losses"] for r in reference], "the monitored run trains as ZeRO-1"
    assert [r["stats"].monitor_steps for r in monitored] == [2, 2]
    assert_monitor_csv(tmp_path / "monitored", steps=[16, 32])
    with pytest.raises(AssertionError, match=r"written at \[8, 16, 24, 32, 40\], not \[16, 32\]"):
        assert_monitor_csv(tmp_path / "every_step", steps=[16, 32])
