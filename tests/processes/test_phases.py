"""Telling slow from stuck: phase stamps, collective counts, and what the harness reports when ranks overstay their
bound (each rank's phase, and its Python stacks); plus the device a rank gets where ranks share a GPU."""

from __future__ import annotations

import json
import time

import pytest
import torch.distributed as dist

from harness.launch import RankTimeout, local_device, run_ranks
from harness.phases import CollectiveCounter, PhaseLog, describe_phases


def test_local_device_is_the_index_among_the_visible_gpus_never_the_rank():
    assert [local_device(r, 1) for r in range(4)] == [0, 0, 0, 0]  # four ranks sharing one GPU
    assert [local_device(r, 2) for r in range(4)] == [0, 1, 0, 1]
    assert [local_device(r, 8) for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="no visible GPU"):
        local_device(0, 0)
    with pytest.raises(ValueError, match="LOCAL_RANK must be >= 0, got -1"):
        local_device(-1, 1)


def test_phase_log_closes_each_phase_with_its_time_and_collectives(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(a))
    counter = CollectiveCounter().install()
    log = PhaseLog(3, directory=str(tmp_path), counter=counter)
    log.enter("step 1 forward (compile)")
    dist.all_reduce("t")
    dist.all_reduce("t")
    log.enter("step 2 forward")
    log.enter("done")
    counter.uninstall()
    assert calls == [("t",), ("t",)] and dist.all_reduce("u") is None and calls[-1] == ("u",)  # restored
    assert [h["phase"] for h in log.history] == ["step 1 forward (compile)", "step 2 forward"]
    assert log.history[0]["collectives"].startswith("2 torch.distributed calls (all_reduce 2), ")
    assert log.history[1]["collectives"] == "no torch.distributed calls"
    state = json.loads((tmp_path / "rank3.json").read_text())
    assert state["phase"] == "done" and state["rank"] == 3
    lines = capsys.readouterr().out.splitlines()
    assert all(line.startswith("  phase r3 +") for line in lines)
    assert any("enter step 1 forward (compile)" in line for line in lines)
    assert not any("step 2 forward" in line for line in lines), "steps after the first are recorded, not printed"


def test_describe_phases_names_what_each_rank_reported(tmp_path):
    PhaseLog(0, directory=str(tmp_path), echo=False).enter("step 1 backward")
    text = describe_phases(tmp_path, 2, now=time.time() + 30)
    assert text.startswith("rank 0: in 'step 1 backward' for 3")
    assert text.endswith("rank 1: no phase reported (still starting: imports, process group)")


def _sleep_forever() -> None:
    while True:
        time.sleep(0.05)


def _phases_then_stuck(rank: int, world_size: int, directory: str) -> int:
    log = PhaseLog(rank, directory=directory, echo=False)
    log.enter("starting")
    if rank == 1:
        log.enter("waiting in a collective that never completes")
        _sleep_forever()
    log.enter("done")
    return rank


@pytest.mark.timeout(90)
def test_a_rank_past_the_bound_is_reported_with_its_phase_and_its_stack(tmp_path, capfd, monkeypatch):
    # Spawned: a rank forked from the fork server writes to the stderr the server started with, not this test's.
    monkeypatch.setenv("OWNER_REDUCE_START_METHOD", "spawn")
    with pytest.raises(RankTimeout, match=r"ranks \[1\] of 2 did not finish within 10s \(hung collective\?\); "
                                          r"their Python stacks are on stderr"):
        run_ranks(_phases_then_stuck, 2, args=(str(tmp_path),), timeout=10, dist_backend=None)
    text = describe_phases(tmp_path, 2)
    assert "rank 0: in 'done'" in text
    assert "rank 1: in 'waiting in a collective that never completes' for " in text
    err = capfd.readouterr().err
    assert "_sleep_forever" in err and "_phases_then_stuck" in err, err[-2000:]
