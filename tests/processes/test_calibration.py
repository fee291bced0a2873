"""The calibration: fits that recover known latencies and bandwidths, the file format (round trip, validation errors
that name the key, the digest ranks compare), the config key, the flush choice moving with measured times,
the measurement loop on an in-process communicator, and one run on two gloo ranks that must agree byte for byte."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import random
from pathlib import Path

import pytest
import torch

from owner_reduce.planning.calibration import (
    FORMAT,
    MAX_BANDWIDTH_GBS,
    Calibration,
    KindFit,
    P2pFit,
    fit,
    fit_kind,
    fit_p2p,
    format_fits,
    load_calibration,
    max_relative_residual,
)
from owner_reduce.planning.collectives import ALLREDUCE, HANDOFF, REDUCE, REDUCE_SCATTER
from owner_reduce.planning.flush_choice import FlushCost
from owner_reduce.planning.owner_layout import default_cost, plan_owner_layout
from owner_reduce.planning.rank_inputs import read_inputs
from owner_reduce.planning.settings import parse_settings
from owner_reduce.runtime.calibrate import CalibrationOptions, default_peers, measure, plan_measurements
from tests.support.fakes import MirrorComm, flat_map

LADDER = tuple((4 << 10) << (2 * i) for i in range(8))  # 4 KiB .. 64 MiB
KEY = "compile.reduce_to_owner_calibration"


def _read(path) -> object:  # noqa: ANN001
    """What a rank reads where its config names ``path`` (``planning.rank_inputs``)."""
    return read_inputs(parse_settings({"reduce_to_owner": True, "reduce_to_owner_calibration": str(path)}), {})


def _line(latency: float, gbs: float, sizes=LADDER) -> list[tuple[int, float]]:
    return [(b, latency + b / (1000 * gbs)) for b in sizes]


def _cal(world_size: int = 4, **latencies: float) -> Calibration:
    """Every kind at 10 us and 100 GB/s, send/recv at 5 us + 2 us per peer and 50 GB/s; ``latencies`` override."""
    fits = tuple(KindFit(k, latencies.get(k, 10.0), 100.0, tuple(_line(latencies.get(k, 10.0), 100.0, LADDER[:3])))
                 for k in (ALLREDUCE, REDUCE, REDUCE_SCATTER))
    p2p = P2pFit(latencies.get("p2p", 5.0), 2.0, 50.0, ((1, 4096, 7.1), (2, 65536, 10.3)))
    return Calibration(world_size=world_size, backend="cupy-nccl", device="NVIDIA H200", fits=fits, p2p=p2p,
                       measured_at="2026-12-02T00:00:00Z", dtype="bfloat16", warmup=2, repeats=5,
                       software=(("torch", "2.13.0"), ("nccl", "2.30.7")))


# ---- fits ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("latency", "gbs"), [(20.0, 3.5), (0.0, 400.0), (850.0, 0.5), (6.6, 48.0)])
def test_fit_recovers_a_known_line(latency, gbs):
    got_latency, got_gbs = fit(_line(latency, gbs))
    assert got_latency == pytest.approx(latency, abs=1e-6) and got_gbs == pytest.approx(gbs, rel=1e-9)


def test_fit_with_noise_stays_close_and_weighs_every_size():
    rng = random.Random(7)
    noisy = [(b, t * (1 + rng.uniform(-0.03, 0.03))) for b, t in _line(30.0, 20.0)]
    latency, gbs = fit(noisy)
    assert latency == pytest.approx(30.0, rel=0.1) and gbs == pytest.approx(20.0, rel=0.05)
    # Relative residuals: the latency comes from the small sizes, not from the 64 MiB point's noise.
    assert max_relative_residual(fit_kind(ALLREDUCE, noisy)) < 0.07


def test_fit_clamps_to_the_bounds():
    # Times that do not grow with the bytes: all latency, bandwidth at its cap (never 0 or negative).
    latency, gbs = fit([(b, 50.0) for b in LADDER])
    assert gbs == MAX_BANDWIDTH_GBS and latency == pytest.approx(50.0, rel=0.05)  # 64 MiB at the cap: 6.7 us
    # Small sizes below the straight line (an intercept < 0 unbounded): latency 0, never negative.
    latency, gbs = fit([(4096, 0.5), (1 << 20, 1000.0), (1 << 22, 4000.0)])
    assert latency == 0.0 and 0 < gbs < MAX_BANDWIDTH_GBS
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit([(4096, 1.0), (4096, 2.0)])


def test_p2p_fit_recovers_latency_per_peer_and_bandwidth():
    points = [(p, b, 10.0 + 3.0 * p + b / (1000 * 2.0)) for p in (1, 2, 4) for b in LADDER[:5]]
    got = fit_p2p(points)
    assert (got.latency_us, got.per_peer_us, got.bandwidth_gbs) == pytest.approx((10.0, 3.0, 2.0), rel=1e-6)
    assert got.round_us(3, 8192) == pytest.approx(10 + 9 + 8192 / 2000)
    # One peer count cannot separate the per-peer cost from the latency: it is folded into the latency.
    single = fit_p2p([(1, b, 13.0 + b / 2000) for b in LADDER[:4]])
    assert single.per_peer_us == 0.0 and single.latency_us == pytest.approx(13.0)


# ---- the calibration as CallTimes ------------------------------------------------------------------------------------


def test_call_times_and_unmeasured_kinds():
    cal = _cal()
    assert cal.call_us(REDUCE, 1_000_000) == pytest.approx(10.0 + 1_000_000 / 100_000)
    assert cal.call_us(REDUCE, 0) == 0.0 and cal.p2p_round_us(0, 0) == 0.0
    assert cal.p2p_round_us(2, 50_000) == pytest.approx(5 + 4 + 1)
    partial = dataclasses.replace(cal, fits=cal.fits[:1], p2p=None)
    with pytest.raises(ValueError, match="no 'reduce_scatter' measured.*allreduce"):
        partial.call_us(REDUCE_SCATTER, 10)
    with pytest.raises(ValueError, match="no send/recv round"):
        partial.p2p_round_us(1, 10)
    cal.check_world_size(4)
    with pytest.raises(ValueError, match="measured on 4 ranks, this run has 8"):
        cal.check_world_size(8)


def test_flush_cost_sums_the_calibrated_aggregates():
    cal = _cal()
    cost = FlushCost(default_cost(4).topology, dtype_bytes=2, calibration=cal)
    assert cost.calls_us([(REDUCE, 1000)]) == pytest.approx(cal.call_us(REDUCE, 2000))
    # Two Reduces of similar size aggregate into one (NCCL's planner, as collective_time): one latency.
    assert cost.calls_us([(REDUCE, 1000), (REDUCE, 1000)]) == pytest.approx(cal.call_us(REDUCE, 4000))


def test_a_calibration_moves_the_flush_choice():
    m = flat_map([50_000] * 8, 4)  # four equal partitions: a whole-model flush covering every rank
    grads = [(p.param_id, p.numel) for p in reversed(list(m))]
    topology = default_cost(4).topology
    assert plan_owner_layout(grads, m, cost=FlushCost(topology, calibration=_cal())).choice == REDUCE_SCATTER
    # ReduceScatter measured slow (a fabric without a fast one): the choice leaves it.
    slow_rs = plan_owner_layout(grads, m, cost=FlushCost(topology, calibration=_cal(reduce_scatter=10_000.0)))
    assert slow_rs.choice not in (REDUCE_SCATTER, HANDOFF)
    assert dict(slow_rs.costs)[REDUCE_SCATTER] > 10_000 > slow_rs.modelled_us
    # Every Reduce and the ReduceScatter slow, AllReduce fast: one AllReduce.
    cheap_ar = _cal(reduce_scatter=10_000.0, reduce=10_000.0, allreduce=1.0)
    assert plan_owner_layout(grads, m, cost=FlushCost(topology, calibration=cheap_ar)).choice == ALLREDUCE


def test_the_hand_off_round_is_costed_on_the_calibration():
    m = flat_map([40, 30, 20, 10], 4)  # partitions of 25
    arrival = [(1, 30), (0, 40)]  # regions 25, 25, 20 on ranks 0-2, packed in 4 chunks of 18: pieces move
    topology = default_cost(4).topology
    cheap = plan_owner_layout(arrival, m, cost=FlushCost(topology, force=HANDOFF, calibration=_cal()))
    slow = plan_owner_layout(arrival, m, cost=FlushCost(topology, force=HANDOFF, calibration=_cal(p2p=1e6)))
    assert cheap.transfers and cheap.choice == HANDOFF
    assert dict(slow.costs)[HANDOFF] - dict(cheap.costs)[HANDOFF] == pytest.approx(1e6 - 5.0)


# ---- the file ------------------------------------------------------------------------------------------------------


def test_json_round_trip_and_digest():
    cal = _cal()
    text = cal.to_json()
    assert json.loads(text)["format"] == FORMAT
    back = Calibration.from_json(text)
    assert back == cal and back.digest() == cal.digest()
    # The digest is of the content, not of the text's layout or key order.
    shuffled = json.dumps(dict(reversed(list(json.loads(text).items()))))
    assert Calibration.from_json(shuffled).digest() == cal.digest()
    assert len(cal.digest()) == 12 and cal.digest() == "907371cdeabb"  # stable across runs and machines
    assert dataclasses.replace(cal, world_size=8).digest() != cal.digest()
    edited = json.loads(text)
    edited["fits"]["reduce"]["latency_us"] = 11.0
    assert Calibration.from_dict(edited).digest() != cal.digest()


def _mutated(change) -> str:
    data = json.loads(_cal().to_json())
    change(data)
    return json.dumps(data)


@pytest.mark.parametrize(("change", "key"), [
    (lambda d: d.update(format="owner_reduce.calibration/0"), "'format'"),
    (lambda d: d.pop("world_size"), "'world_size' is missing"),
    (lambda d: d.update(world_size=True), "'world_size'"),
    (lambda d: d.update(fit={}), "'fit' is not part of"),
    (lambda d: d["fits"]["reduce"].update(bandwidth_gbs=-1), "'fits.reduce.bandwidth_gbs' must be a positive"),
    (lambda d: d["fits"]["reduce"].update(bandwidth_gbs=0), "'fits.reduce.bandwidth_gbs'"),
    (lambda d: d["fits"]["allreduce"].pop("latency_us"), "'fits.allreduce.latency_us' is missing"),
    (lambda d: d["fits"]["allreduce"].update(latency_us="fast"), "'fits.allreduce.latency_us'"),
    (lambda d: d["fits"].update(broadcast=d["fits"]["reduce"]), "'fits.broadcast' is not a call kind"),
    (lambda d: d["fits"]["reduce_scatter"]["points"].append([1]), r"'fits.reduce_scatter.points\[3\]'"),
    (lambda d: d["p2p"].update(per_peer_us=-2), "'p2p.per_peer_us'"),
    (lambda d: d["p2p"]["points"][0].__setitem__(0, 0), r"'p2p.points\[0\]\[0\]'"),
    (lambda d: d.update(software={"torch": 2}), "'software.torch'"),
])
def test_validation_errors_name_the_key(change, key):
    with pytest.raises(ValueError, match=f"calibration here.json: key {key}"):
        Calibration.from_json(_mutated(change), source="here.json")


def test_load_names_the_file(tmp_path):
    good = tmp_path / "c.json"
    good.write_text(_cal().to_json())
    assert load_calibration(good) == _cal()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=f"calibration {bad}: not JSON"):
        load_calibration(bad)
    with pytest.raises(ValueError, match=f"calibration {tmp_path / 'none.json'}: cannot be read"):
        load_calibration(tmp_path / "none.json")


def test_the_config_key_names_the_file_each_rank_reads(tmp_path):
    assert read_inputs(parse_settings({"reduce_to_owner": True}), {}).calibration is None
    good = tmp_path / "c.json"
    good.write_text(_cal().to_json())
    assert _read(good).calibration == _cal()
    missing = tmp_path / "missing.json"
    ((_, reason),) = _read(missing).problems
    assert reason.startswith(f"{KEY}='{missing}': calibration {missing}: cannot be read"), reason
    invalid = tmp_path / "invalid.json"
    invalid.write_text(_mutated(lambda d: d["fits"]["reduce"].update(bandwidth_gbs=-1)))
    ((_, reason),) = _read(invalid).problems
    assert reason.startswith(f"{KEY}='{invalid}'") and "key 'fits.reduce.bandwidth_gbs'" in reason, reason


def test_format_fits_names_every_fit():
    cal = _cal()
    lines = format_fits(cal)
    assert lines[0].startswith(f"owner_reduce: calibration {cal.digest()}: 4 ranks, cupy-nccl on NVIDIA H200")
    assert [line.split()[1] for line in lines[1:]] == ["allreduce", "reduce", "reduce_scatter", "send/recv", "per"]
    assert "2.0 us per peer" in lines[-2] and all(line.startswith("owner_reduce:") for line in lines)
    assert "per call        not measured (host was not among --kinds): the default host cost is charged" in lines[-1]
    assert not any("cap" in line for line in lines)
    flat = dataclasses.replace(cal, fits=(fit_kind(REDUCE, [(b, 50.0) for b in LADDER]),))
    assert "bandwidth at its cap" in format_fits(flat)[1]


# ---- the measurement -----------------------------------------------------------------------------------------------


def test_ladder_rounds_to_what_each_call_moves():
    ms = plan_measurements(CalibrationOptions(sizes=(4096, 10_000)), world_size=3, element_size=4, on_gpu=False)
    by = {(m.kind, m.nbytes, m.peers) for m in ms}
    assert ("reduce_scatter", 4092, 0) in by and ("reduce_scatter", 9996, 0) in by  # 3 equal blocks of elements
    assert ("p2p", 4096, 1) in by and ("p2p", 4096, 2) in by and ("p2p", 10_000, 2) in by
    assert default_peers(2) == (1,) and default_peers(4) == (1, 2, 3) and default_peers(64) == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="peers must be in 1..2"):
        plan_measurements(CalibrationOptions(peers=(3,)), world_size=3, element_size=4, on_gpu=False)
    with pytest.raises(ValueError, match="two distinct positive"):
        CalibrationOptions(sizes=(4096,))
    # Partners on other nodes (stride = ranks per node): at most (16 - 1) // 8 = 1 peer at ws 16.
    strided = plan_measurements(CalibrationOptions(sizes=(4096, 8192), peer_stride=8), world_size=16, element_size=4,
                                on_gpu=False)
    assert {m.peers for m in strided if m.kind == "p2p"} == {1}


class _RecordingComm(MirrorComm):
    """MirrorComm whose receives only count (the calibration's round is not a hand-off)."""

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        self.calls.append(("recv", peer, buf.numel()))


def test_measure_issues_the_ladder_in_groups_and_fits_every_kind():
    comm = _RecordingComm(rank=1, world_size=3)
    options = CalibrationOptions(sizes=(4096, 65536), peers=(1, 2), warmup=1, repeats=2)
    cal = measure(comm, options, torch.device("cpu"), "mirror", "cpu")
    assert [f.kind for f in cal.fits] == [ALLREDUCE, REDUCE, REDUCE_SCATTER] and cal.p2p is not None
    assert {p[0] for p in cal.p2p.points} == {1, 2} and cal.world_size == 3
    sends = [c for c in comm.calls if c[0] == "send"]
    assert {peer for _, peer, _ in sends} == {2, 0}  # ring neighbours at +1 and +2 of rank 1
    reduces = [c for c in comm.calls if c[0] == "reduce"]
    assert reduces and all(root == 0 for _, root, _ in reduces)
    # 2 sizes x (3 kinds + 2 peer counts) x (1 warm-up + 2 repeats), one group each, and the per-call measurement's
    # 5 groups (1, 2, 4, 8, 16 AllReduces of 64 KiB in all) x 3; meeting AllReduces outside.
    assert comm.groups == 2 * 5 * 3 + 5 * 3 and comm.open_groups == 0
    assert cal.host is not None and [(c, b) for c, b, _ in cal.host.points] == [(n, 65536) for n in (1, 2, 4, 8, 16)]
    strided = _RecordingComm(rank=1, world_size=5)
    measure(strided, dataclasses.replace(options, peer_stride=2), torch.device("cpu"), "mirror", "cpu")
    assert {c[1] for c in strided.calls if c[0] == "send"} == {3, 0}  # +2 and +4 of rank 1
    assert {c[1] for c in strided.calls if c[0] == "recv"} == {4, 2}  # -2 and -4
    comm.gathered_rows = [[1, 0], [2, 0], [1, 0]]  # rank 1 runs another ladder
    with pytest.raises(RuntimeError, match=r"ladders differ between ranks \(rank 1 differs from rank 0\)"):
        measure(comm, options, torch.device("cpu"), "mirror", "cpu")


def test_script_parses_sizes():
    spec = importlib.util.spec_from_file_location("calibrate_script",
                                                  Path(__file__).resolve().parents[2] / "scripts" / "calibrate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.parse_sizes("4096, 4KiB,64M,1g") == (4096, 4096, 64 << 20, 1 << 30)
    with pytest.raises(Exception, match="not a size"):
        script.parse_size("4 lots")


# ---- two gloo ranks ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_two_gloo_ranks_write_the_same_calibration(tmp_path):
    from harness.launch import run_ranks
    from owner_reduce.runtime.calibrate import local_rank_worker

    options = CalibrationOptions(sizes=(4096, 65536, 262144), warmup=1, repeats=3)
    results = run_ranks(local_rank_worker, 2, args=(options,), timeout=150, env={"DS_ACCELERATOR": "cpu"})
    (digest0, text0), (digest1, text1) = results
    assert digest0 == digest1 and text0 == text1
    path = tmp_path / "calibration.json"
    path.write_text(text0)
    cal = load_calibration(path)
    assert cal.digest() == digest0 and cal.world_size == 2 and cal.backend == "torch.distributed/gloo"
    assert [f.kind for f in cal.fits] == [ALLREDUCE, REDUCE, REDUCE_SCATTER] and cal.p2p is not None
    assert all(len(f.points) == 3 and f.latency_us >= 0 and f.bandwidth_gbs > 0 for f in cal.fits)
    assert cal.call_us(ALLREDUCE, 1 << 20) > 0 and cal.p2p_round_us(1, 4096) > 0


# ---- the runtime uses it (compile.reduce_to_owner_calibration, agreed at init) ---------------------------------------


def _exchange_runtimes(cals, numels=(50_000,) * 8):
    from tests.support.fakes import ExchangeWorld, mirror_runtime

    world = ExchangeWorld(len(cals), timeout_s=20)
    m = flat_map(list(numels), len(cals))
    runtimes = world.run(lambda rank: mirror_runtime(m, rank=rank, comm=world.comm(rank), calibration=cals[rank])[0])
    return world, runtimes, m


def _one_backward(world, runtimes, m):
    def backward(rank):
        rt = runtimes[rank]
        rt.start_backward(True)
        for p in reversed(list(m)):
            rt.reduce_grad(torch.ones(p.numel), 11, p.param_id)
        rt.end_backward(11, False)

    world.run(backward)


@pytest.mark.timeout(60)
def test_the_runtime_chooses_on_the_calibration_every_rank_loaded():
    """Four in-process ranks that really exchange: with a calibration whose ReduceScatter is slow the schedule
    leaves the ReduceScatter NCCL's tables pick, the same on every rank, and says what it was costed on."""
    from tests.support.ds_log import ds_log

    world, runtimes, m = _exchange_runtimes([None] * 4)
    _one_backward(world, runtimes, m)
    _one_backward(world, runtimes, m)
    assert "reduce_scatter x1" in runtimes[0].stats.schedule_lines[0]
    slow = _cal(reduce_scatter=10_000.0)
    with ds_log(logging.DEBUG) as log:
        world, runtimes, m = _exchange_runtimes([slow] * 4)
        _one_backward(world, runtimes, m)
        before = [len(c.calls) for c in world.comms]
        _one_backward(world, runtimes, m)
    (line,) = runtimes[0].stats.schedule_lines
    assert "reduce_scatter" not in line.split(";")[0], line
    assert f"calibration {slow.digest()}," in runtimes[0].stats.settings_line  # the settings line names it
    calls = [c.calls[n:] for c, n in zip(world.comms, before, strict=True)]
    assert all(not any(kind == "reduce_scatter" for kind, _, _ in c) for c in calls), calls
    assert any(f.startswith(f"owner_reduce: calibration {slow.digest()}: 4 ranks") for f in log.at(logging.INFO))
    # what the schedule line leaves out, at DEBUG: what it was costed on
    assert any(f"modelled on the call times of calibration {slow.digest()}" in f for f in log.at(logging.DEBUG))


@pytest.mark.timeout(30)
def test_ranks_with_different_calibrations_refuse_naming_the_key_and_a_wrong_world_size_is_refused():
    from owner_reduce.runtime.handle import OwnerReduceMismatchError

    with pytest.raises(OwnerReduceMismatchError, match=f"{KEY} names different calibrations "
                                                       "across ranks: .* on rank 0, none on rank 1"):
        _exchange_runtimes([_cal(world_size=2), None])
    with pytest.raises(OwnerReduceMismatchError, match=f"refusing to start: ranks 0, 1: {KEY}: the "
                                                       "calibration was measured on 4 ranks, this run has 2"):
        _exchange_runtimes([_cal(world_size=4)] * 2)


# ---- issue 31: refused at init, together; no communicator that no flush can use -------------------------------


def test_an_incomplete_calibration_is_refused_when_read_naming_what_it_lacks(tmp_path):
    full = _cal()
    assert full.missing_for_runtime() == []
    partial = dataclasses.replace(full, fits=full.fits[:2], p2p=None)  # written with --kinds allreduce,reduce
    path = tmp_path / "partial.json"
    path.write_text(partial.to_json())
    inputs = _read(path)
    assert inputs.calibration is None
    ((key, reason),) = inputs.problems
    assert key == KEY and reason == (
        f"{KEY}='{path}': the calibration lacks reduce_scatter, the send/recv round (p2p) (written with --kinds, "
        "or edited); the runtime costs every candidate on it: rerun scripts/calibrate.py without --kinds")
    off = parse_settings({"reduce_probe": True, "reduce_to_owner_calibration": str(path)})
    assert read_inputs(off, {}).problems == ()  # not read: the owner path is off


@pytest.mark.timeout(30)
def test_an_incomplete_calibration_on_every_rank_refuses_at_init_not_after_the_first_step(tmp_path):
    """Before: the runtime started, and every rank failed inside the first backward that costed a ReduceScatter."""
    from owner_reduce.runtime.handle import OwnerReduceMismatchError
    from tests.support.fakes import ExchangeWorld, mirror_runtime

    partial = dataclasses.replace(_cal(world_size=2), fits=_cal().fits[:2])
    path = tmp_path / "partial.json"
    path.write_text(partial.to_json())
    inputs = _read(path)
    world = ExchangeWorld(2, timeout_s=20)
    with pytest.raises(OwnerReduceMismatchError, match=rf"refusing to start: ranks 0, 1: {KEY}=.* "
                                                       r"lacks reduce_scatter"):
        world.run(lambda rank: mirror_runtime(flat_map([50_000] * 8, 2), rank=rank, comm=world.comm(rank),
                                              env_problems=inputs.problems))


@pytest.mark.timeout(30)
def test_under_a_calibration_no_node_or_rail_communicator_is_made(monkeypatch):
    """Two nodes of two: without a calibration the node, rail and node hand-off communicators are made (two-level is a
    candidate); under one they are not (not a candidate: no creations, no device memory, no "two-level flush
    ready")."""
    from tests.support.ds_log import ds_log
    from tests.support.fakes import ExchangeWorld, group_threads_as_nodes, mirror_runtime

    group_threads_as_nodes(monkeypatch, 2)
    m = flat_map([50_000] * 8, 4)
    for cal in (None, _cal(world_size=4)):
        world = ExchangeWorld(4, timeout_s=20)
        with ds_log() as log:
            runtimes = world.run(lambda rank, cal=cal, world=world: mirror_runtime(m, rank=rank,
                                                                                   comm=world.comm(rank),
                                                                                   calibration=cal)[0])
        out = log.text()
        made = [rt.comm.subs for rt in runtimes]
        if cal is None:
            assert all([sub.role for sub in subs] == ["node", "rail", "node hand-off"] for subs in made)
            assert "two-level flush ready" in out
        else:
            assert made == [[]] * 4 and all(rt.flusher.levels is None for rt in runtimes)
            assert "two-level flush ready" not in out and runtimes[0].stats.two_level_line is None
            assert (f"owner_reduce: the two-level flush is not a candidate under {KEY}" in out
                    and "no node or rail communicator made" in out)


def _refusing_rank(rank: int, world_size: int, paths: list[str]) -> dict:
    """One owner run whose config names ``paths[rank]``; what init raised (or that it did not), and when."""
    import time

    from harness.toy_training import TrainSpec, train

    start = time.monotonic()
    try:
        train(rank, world_size, TrainSpec(mode="owner", steps=1, reduce_probe=False,
                                          compile_keys=(("reduce_to_owner_calibration", paths[rank]),)))
    except Exception as error:  # noqa: BLE001 - what each rank raised is the result
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


@pytest.mark.timeout(200)
def test_a_calibration_path_missing_on_one_rank_makes_every_rank_refuse_naming_it(tmp_path):
    """The guide's multi-node recipe gone wrong: the file exists on rank 0's node only. Before: rank 1 raised alone and
    rank 0 waited in the first collective of init on DeepSpeed's group (30 minutes), never learning why. Now both reach
    the agreement and refuse at once, naming rank 1, the key and the reason."""
    path = tmp_path / "cal.json"
    path.write_text(_cal(world_size=2).to_json())
    missing = tmp_path / "elsewhere" / "cal.json"
    from harness.launch import run_ranks

    r0, r1 = run_ranks(_refusing_rank, 2, args=([str(path), str(missing)],), timeout=150)
    for r in (r0, r1):
        assert r["error"] is not None and r["error"].startswith("OwnerReduceMismatchError: owner_reduce on rank "), r
        assert (f"refusing to start: rank 1: {KEY}='{missing}': calibration {missing}: cannot be "
                "read (No such file or directory)") in r["error"], r["error"]
        assert f"{KEY} names different calibrations across ranks" in r["error"]
        assert r["seconds"] < 60, r  # no rank waited for a deadline: both refused at the agreement
