"""The Python runtime's bookkeeping, in-process, with a mirror communicator (no processes)."""

import types

import pytest
import torch

from owner_reduce.planning.flags import OwnerReduceFlags
from owner_reduce.planning.owner_map import OwnerMap
from owner_reduce.planning.settings import OwnerReduceSettings
from owner_reduce.runtime.handle import OwnerReduceMismatchError, OwnerReduceRuntime
from tests.support.fakes import NUMELS, TABLES, MirrorComm, ws2_runtime


def _runtime(rank=0, owner=True, probe=True, bucket=64, problems=(), comm=None):
    return ws2_runtime(rank, owner, probe, bucket, problems, comm)


def _rank0_runtime(bucket=64, device="cpu"):
    """Rank 0 of 2, owner path on, probe off; grad buffers as DeepCompile registers them on rank 0 (offset 0)."""
    comm = MirrorComm(rank=0)
    rt = OwnerReduceRuntime(OwnerReduceSettings(OwnerReduceFlags(True, False)), OwnerMap.from_group_tables([TABLES], 2),
                            lambda group: comm)
    rt.init(None, types.SimpleNamespace(double_buffer=True), bucket)
    buffers = {0: torch.zeros(6, device=device), 1: torch.zeros(2, device=device), 2: torch.empty(0, device=device)}
    for pid, buf in buffers.items():
        rt.register_param(pid, (NUMELS[pid],), torch.zeros(NUMELS[pid], device=device), buf, 0)
    return rt, buffers


def _grads(scale=1.0):
    return {pid: torch.arange(1, n + 1, dtype=torch.float32) * scale for pid, n in NUMELS.items()}


def _backward(rt, grads, update=True, order=(2, 1, 0)):
    rt.start_backward(update)
    for pid in order:
        rt.reduce_grad(grads[pid], 11, pid)
    rt.end_backward(11, False)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("owner", [True, False])
def test_copy_out_gets_the_reduced_value_on_the_keeper(rank, owner):
    rt, comm = _runtime(rank=rank, owner=owner)
    grads = _grads()
    _backward(rt, grads)
    # Identical data on 2 ranks, pre-divided by 2, summed: the gradient itself, never NaN.
    for pid, param in rt._params.items():
        buf = param.grad_buffer
        if buf.numel():
            expected = grads[pid][param.offset:param.offset + buf.numel()]
            assert torch.equal(buf, expected), (pid, buf, expected)
    # Order c, b, a: c -> r1; b's [0, 2) -> r0 and [2, 5) -> r1 (sliced); a -> r0.
    assert comm.calls == ([("reduce", 1, 5), ("reduce", 0, 2), ("reduce", 1, 3), ("reduce", 0, 6)] if owner
                          else [("all_reduce", None, 16)])
    assert comm.groups == 1 and comm.open_groups == 0
    assert rt.stats.owner_elems == (16 if owner else 0) and rt.stats.flushes == 1


def test_accumulation_across_micro_steps_then_one_reduction():
    rt, comm = _runtime()
    _backward(rt, _grads(1.0), update=False)
    _backward(rt, _grads(2.0), update=False)
    assert comm.calls == [] and rt.stats.accumulated_calls == 6
    _backward(rt, _grads(4.0), update=True)
    assert torch.equal(rt._params[0].grad_buffer, _grads(7.0)[0])
    assert torch.equal(rt._params[1].grad_buffer, _grads(7.0)[1][:2])


def test_accumulation_does_not_alias_the_graph_gradient():
    rt, _ = _runtime()
    grads = _grads()
    original = {pid: g.clone() for pid, g in grads.items()}
    _backward(rt, grads, update=False)
    _backward(rt, _grads(), update=True)
    assert all(torch.equal(grads[pid], original[pid]) for pid in grads), "the runtime wrote into a graph tensor"


def test_small_bucket_flushes_on_overflow_and_grows_for_a_large_gradient():
    rt, comm = _runtime(bucket=6)
    grads = _grads()
    _backward(rt, grads, order=(0, 1, 2))  # 6 fills the bucket; 5 overflows -> flush; 5 again -> flush
    assert rt.stats.flushes == 3 and len(rt.stats.probe_lines) == 3
    assert torch.equal(rt._params[0].grad_buffer, grads[0])
    rt2, _ = _runtime(bucket=4)  # every gradient is larger than the bucket: it grows
    _backward(rt2, grads)
    assert torch.equal(rt2._params[0].grad_buffer, grads[0]) and rt2.stats.flushes == 3


def test_profiling_communicates_nothing():
    rt, comm = _runtime()
    rt.enable_profiling(True)
    _backward(rt, _grads())
    assert comm.calls == [] and rt.stats.profiling_calls == 3 and rt.stats.reduce_grad_calls == 0
    rt.enable_profiling(False)
    assert not rt.is_profiling()


def test_a_grad_buffer_on_a_non_owner_is_refused():
    rt, comm = _runtime(rank=0)
    with pytest.raises(RuntimeError, match=r"elements \[0, \+5\) of param 2, which reduce elsewhere"):
        rt.update_param_grad_buffer(2, torch.zeros(5), 0)  # rank 0 claims c, owned by rank 1
    assert comm.calls == [], "refused before any collective"


def test_a_straddler_slice_of_another_rank_is_refused():
    rt, _ = _runtime(rank=0)
    with pytest.raises(RuntimeError, match=r"\[2, \+3\) of param 1, which reduce elsewhere"):
        rt.update_param_grad_buffer(1, torch.zeros(3), 2)  # rank 0 claims b's [2, 5), rank 1's slice


def test_registered_buffers_start_at_zero():
    rt, _ = _runtime(rank=0)
    stale = torch.full((6,), 7.0)
    rt.update_param_grad_buffer(0, stale, 0)
    assert torch.equal(stale, torch.zeros(6))


def test_stage2_two_graphs_keep_accumulating_their_own_parameters():
    """z2.cpp clears has_acc_grad per graph: a graph flushed later in the update step still adds."""
    rt, buffers = _rank0_runtime()
    rt.register_graph_z2(21, [1, 2])  # backward runs graph 21 first, then graph 20
    rt.register_graph_z2(20, [0])
    for update, scale in ((False, 1.0), (True, 10.0)):
        rt.start_backward(update)
        for graph, pids in ((21, (1, 2)), (20, (0,))):
            for pid in pids:
                rt.reduce_grad(_grads(scale)[pid], graph, pid)
            rt.end_backward(graph, False)
    assert torch.equal(buffers[0], _grads(11.0)[0]) and torch.equal(buffers[1], _grads(11.0)[1][:2])


def test_stage2_reduces_every_micro_step_and_accumulates_in_the_buffer():
    rt, buffers = _rank0_runtime()
    rt.register_graph_z2(12, [0, 1, 2])
    for update, scale in ((False, 1.0), (True, 2.0)):
        rt.start_backward(update)
        for pid, g in _grads(scale).items():
            rt.reduce_grad(g, 12, pid)
        rt.end_backward(12, False)
    assert rt.stats.flushes == 2 and rt.stats.accumulated_calls == 0
    assert torch.equal(buffers[0], _grads(3.0)[0])  # sum of both micro-steps
    rt.start_backward(True)  # a new step overwrites
    for pid, g in _grads(5.0).items():
        rt.reduce_grad(g, 12, pid)
    rt.end_backward(12, False)
    assert torch.equal(buffers[0], _grads(5.0)[0])
    with pytest.raises(RuntimeError, match="registered for ZeRO stage 1"):
        rt.register_graph_z1(13, [0])


def test_probe_lines_stop_after_twenty_flushes():
    rt, _ = _runtime()
    for _ in range(25):
        _backward(rt, _grads())
    assert len(rt.stats.probe_lines) == 20 and rt.stats.flushes == 25
    assert rt.stats.probe_lines[-1].startswith("[dc-probe][r0] flushReduceBucket #20 dtype=Float tasks=3 ")


@pytest.mark.parametrize("field,name", [("flags", "flags differ across ranks: 3 on rank 0, 11 on rank 1"),
                                        ("bucket", "reduce_bucket_size differs across ranks: 64 on rank 0, 65 on "
                                                   "rank 1"),
                                        ("map_digest", "the owner map differs across ranks"),
                                        ("flags", "compile.reduce_to_owner differs across ranks: true on rank 0, "
                                                  "false on rank 1"),
                                        ("algo", "compile.reduce_to_owner_algo differs across ranks: auto on rank 0, "
                                                 "model on rank 1"),
                                        ("timeout_ms", "compile.reduce_to_owner_timeout_s differs across ranks: unset "
                                                       "on rank 0, 0.001 s on rank 1")])
def test_agreement_mismatch_is_refused(field, name):
    from dataclasses import replace

    from owner_reduce.planning.nodes import pack_host
    from owner_reduce.runtime.agreement import PROTOCOL, AgreementRow

    comm = MirrorComm()
    owner_map = OwnerMap.from_group_tables([TABLES], 2)
    rt = OwnerReduceRuntime(OwnerReduceSettings(OwnerReduceFlags(True, True)), owner_map, lambda group: comm)
    # The wire order (``AgreementRow``): protocol, flags, bucket, map digest, algo (compile.reduce_to_owner_algo), map
    # problems, LOCAL_WORLD_SIZE, sm, compile.reduce_to_owner_timeout_s (ms), calibration, local rank, host digest,
    # nvlinks, verdicts, reasons' length, the launcher's variable, SLURM's variable, SLURM's count, global rank,
    # monitor, runtime number, host
    good = [PROTOCOL, 3, 64, int(owner_map.digest()[:15], 16), 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0,
            0, -1, 0, 0, 0, 1, *pack_host("gpu-node-01")]
    record = AgreementRow.unpack(good)
    assert record.pack() == good
    assert (record.flags, record.bucket, record.slurm_var, record.runtime_number) == (3, 64, -1, 1)
    changed = getattr(record, field) + (1 if not name.startswith("flags") else 8)  # an unknown flag bit: generic
    if name.startswith("compile.reduce_to_owner differs"):
        changed = 2  # reduce_to_owner off on rank 1
    comm.gathered_rows = [good, replace(record, **{field: changed}).pack()]
    with pytest.raises(OwnerReduceMismatchError, match=name) as refused:
        rt.init(None, types.SimpleNamespace(double_buffer=True), 64)
    assert refused.value.fields == (field,)


def test_map_problems_on_any_rank_are_refused():
    with pytest.raises(OwnerReduceMismatchError, match="contradicts the optimizer on ranks"):
        _runtime(problems=("group 0: first_offset map 1, optimizer 0",),
                 comm=MirrorComm())


def test_cleanup_and_unknown_methods():
    rt, comm = _runtime()
    released = []
    rt.on_cleanup = lambda: released.append(True)
    rt.cleanup()
    assert released == [True] and rt.comm is None
    with pytest.raises(AttributeError, match="no DeepCompile handle method 'register_graph_z3'"):
        rt.register_graph_z3(1, [])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (stream discipline)")
@pytest.mark.parametrize("bucket", [64, 6, 4])
def test_cuda_streams_give_the_same_result(bucket):
    """Copies on the current stream, the reduce stream, free events: the same values as on CPU, with buckets reused
    and grown."""
    cuda = torch.device("cuda")
    rt, buffers = _rank0_runtime(bucket=bucket, device=cuda)
    rt.register_graph_z1(11, [0, 1, 2])
    for step in range(3):
        grads = {pid: g.to(cuda) * (step + 1) for pid, g in _grads().items()}
        _backward(rt, grads)
        torch.testing.assert_close(buffers[0], grads[0], rtol=0, atol=0)
        torch.testing.assert_close(buffers[1], grads[1][:2], rtol=0, atol=0)
    assert type(rt.placer.streams).__name__ == "CudaStreams"


# ---- host path: cached flush plans, bucket sizing and lifetime, no per-step allocation ------------------------

def _kept_matches(rt, grads):
    """Every non-empty grad buffer holds its slice of the gradient (identical data on both ranks, pre-divided)."""
    return all(torch.equal(p.grad_buffer, grads[pid][p.offset:p.offset + p.grad_buffer.numel()])
               for pid, p in rt._params.items() if p.grad_buffer.numel())


@pytest.mark.parametrize("rank", [0, 1])
def test_flush_plan_is_reused_for_the_same_content_and_replanned_when_it_changes(rank):
    rt, comm = _runtime(rank=rank, probe=False)
    grads = _grads()
    _backward(rt, grads, order=(2, 1, 0))  # arrival order, learns the graph's owner-ordered schedule
    _backward(rt, grads, order=(2, 1, 0))  # follows it: one plan for the scheduled flush
    _backward(rt, grads, order=(2, 1, 0))
    assert rt.plans_computed == 2 and _kept_matches(rt, grads)
    _backward(rt, _grads(3.0), order=(0, 1, 2))  # leaves the schedule: other content in arrival order
    assert rt.plans_computed == 3 and _kept_matches(rt, _grads(3.0))
    assert comm.calls[-2:] == [("reduce", 0, 8), ("reduce", 1, 8)]  # a + b[0:2] -> r0, b[2:5] + c -> r1
    _backward(rt, _grads(5.0), order=(2, 1, 0))  # back to the first content: its plan again, not a new one
    assert rt.plans_computed == 3 and _kept_matches(rt, _grads(5.0))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stale_plan_would_misroute_and_is_caught(rank, monkeypatch):
    """Negative control for the test above: a cache that ignores the content gives wrong grad buffers."""
    rt, _ = _runtime(rank=rank, probe=False)
    _backward(rt, _grads(), order=(2, 1, 0))
    stale = next(iter(rt.flusher._cache.values()))
    monkeypatch.setattr(rt.flusher, "_arrival", lambda pending, dtype: stale)
    _backward(rt, _grads(3.0), order=(0, 1, 2))
    assert not _kept_matches(rt, _grads(3.0))


def test_a_new_grad_buffer_drops_the_cached_copy_out():
    rt, _ = _runtime(rank=0, probe=False)
    _backward(rt, _grads())
    moved = torch.zeros(6)
    rt.update_param_grad_buffer(0, moved, 0)
    _backward(rt, _grads(2.0))
    assert torch.equal(moved, _grads(2.0)[0]) and rt.plans_computed == 2


def test_fault_injection_still_reaches_cached_plans(monkeypatch):
    """The harness's negative controls replace plan_flush in the flush module; the cache must plan through it."""
    import owner_reduce.runtime.flush as flush_module
    import owner_reduce.runtime.placement as placement_module
    from harness.faults import inject

    monkeypatch.setattr(flush_module, "plan_flush", flush_module.plan_flush)  # restored after the test
    monkeypatch.setattr(placement_module, "plan_owner_layout", placement_module.plan_owner_layout)  # broken too
    monkeypatch.setattr(placement_module, "plan_step_layouts", placement_module.plan_step_layouts)
    inject("wrong_root", 2)
    rt, _ = _runtime(rank=1, probe=False)  # the first owner range, c -> rank 1, now goes to rank 0
    _backward(rt, _grads())
    assert not _kept_matches(rt, _grads())


@pytest.mark.parametrize("bucket,expected", [(64, 16), (10, 10), (16, 16)])
def test_bucket_size_follows_the_registered_gradients(bucket, expected):
    """min(reduce_bucket_size, registered gradient elements of the dtype): 6 + 5 + 5 = 16 float32 elements."""
    rt, _ = _runtime(bucket=bucket, probe=False)
    _backward(rt, _grads())
    current = rt.placer.buckets.current(torch.float32)
    assert current.size == expected and current.buffer.numel() == expected
    assert rt.placer.buckets._shadow == {}, "no shadow bucket on CPU: nothing overlaps a flush there"
    assert rt.placer.buckets.size_for(torch.float16) == bucket, "a dtype with no registered gradient keeps the config"


def test_buckets_are_kept_across_steps_and_released_as_the_native_runtime_does():
    rt, comm = _runtime(probe=False)
    _backward(rt, _grads())
    buffer = rt.placer.buckets.current(torch.float32).buffer
    _backward(rt, _grads(2.0))
    assert rt.placer.buckets.current(torch.float32).buffer is buffer and comm.buffer_releases == 0
    rt.start_backward(True)
    for pid, g in _grads(3.0).items():
        rt.reduce_grad(g, 11, pid)
    rt.end_backward(11, True)  # release_reduce_buckets: deepcompile.cpp clears the shared buckets
    assert rt.placer.buckets._current == {} and comm.buffer_releases == 1 and _kept_matches(rt, _grads(3.0))
    _backward(rt, _grads(4.0))
    assert _kept_matches(rt, _grads(4.0))


def _allocated_bytes(fn):
    """Bytes of every new tensor storage created while ``fn`` runs (views and in-place results do not count)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    total = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            total[0] += sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs)
            return out

    with Count():
        fn()
    return total[0]


def test_the_allocation_counter_sees_an_allocation():
    assert _allocated_bytes(lambda: torch.empty(10)) == 40
    assert _allocated_bytes(lambda: torch.ones(4).narrow(0, 1, 2).add_(1)) == 16  # the ones, not the view


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_steady_state_step_allocates_nothing(grad_accum):
    rt, _ = _runtime(probe=False)
    grads = {scale: _grads(scale) for scale in (1.0, 2.0, 3.0)}

    def step(scale):
        for micro in range(grad_accum):
            _backward(rt, grads[scale], update=micro == grad_accum - 1)

    step(1.0)
    step(2.0)
    assert _allocated_bytes(lambda: step(3.0)) == 0
    assert _kept_matches(rt, _grads(3.0 * grad_accum))


def test_nvlinks_from_the_device_name(monkeypatch):
    from owner_reduce.runtime import topology

    assert topology.nvlinks_of_name("NVIDIA A800-SXM4-80GB") == 8
    assert topology.nvlinks_of_name("NVIDIA H800") == 8
    assert topology.nvlinks_of_name("NVIDIA H100 80GB HBM3") == 0  # the generation's
    assert topology.nvlinks_of_name("NVIDIA A100-SXM4-40GB") == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert topology.nvlinks() == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A800-SXM4-80GB")
    assert topology.nvlinks() == 8


@pytest.mark.timeout(60)
def test_a800_ranks_are_modelled_with_their_eight_nvlinks(monkeypatch):
    """Every rank's GPU an A800 (sm_80, 8 NVLinks): the agreed topology is Ampere's with 8 links, and the schedule's
    DEBUG line names it; the same ranks without the name fact are modelled as A100s (12 links)."""
    import logging

    from owner_reduce.runtime import agreement
    from tests.support.ds_log import ds_log
    from tests.support.fakes import flat_map, mirror_runtime

    monkeypatch.setattr(agreement, "sm_major", lambda device=None: 8)
    names = {}
    for links in (8, 0):
        monkeypatch.setattr(agreement, "nvlinks", lambda device=None, links=links: links)
        m = flat_map([50_000] * 8, 4)
        with ds_log(logging.DEBUG) as log:
            rt, _ = mirror_runtime(m, rank=0)
            names[links] = rt.flusher.cost.topology.name
            for _ in range(2):
                rt.start_backward(True)
                for p in reversed(list(m)):
                    rt.reduce_grad(torch.ones(p.numel), 11, p.param_id)
                rt.end_backward(11, False)
        (detail,) = [line for line in log.at(logging.DEBUG) if line.startswith("[dc-schedule][r0] graph #1: ")]
        assert f"modelled on the alpha-beta model of {names[links]}" in detail, detail
    assert names == {8: "4-GPU NVLink node (ampere, 8 links x 20 GB/s)",
                     0: "4-GPU NVLink node (ampere, 12 links x 20 GB/s)"}



def test_a_two_level_stage_that_raises_still_leaves_the_levels_joined_at_the_next_wait():
    """Before: ``levels_end`` was skipped when a stage raised, so the reduce stream (which every later wait polls) did
    not cover what the node stream had issued. Now every host wait joins the levels first, whatever raised."""
    import contextlib

    from owner_reduce.runtime.streams import CudaStreams

    class Stream:
        def __init__(self, name):
            self.name, self.waited = name, []

        def wait_stream(self, other):
            self.waited.append(other.name)

        def query(self):
            return True

    class Cuda:
        def __init__(self):
            self.current = Stream("compute")

        def Stream(self, device, priority=0):  # noqa: N802 - torch.cuda's name
            return Stream(f"stream{id(self) % 7}-{priority}")

        def current_stream(self, device=None):
            return self.current

        @contextlib.contextmanager
        def stream(self, stream):
            before, self.current = self.current, stream
            try:
                yield
            finally:
                self.current = before

    streams = CudaStreams(torch.device("cpu"), cuda=Cuda())
    with pytest.raises(RuntimeError, match="rail call failed"), streams.levels():
        raise RuntimeError("rail call failed")
    node, rail = streams._levels["node"], streams._levels["rail"]
    node.name, rail.name = "node", "rail"
    polled = []
    streams.synchronize(lambda done: polled.append(done()))
    assert streams.reduce_stream.waited == ["node", "rail"] and polled == [True]


def test_the_free_memory_reading_at_init_waits_for_nothing_on_the_device(monkeypatch):
    from owner_reduce.runtime import levels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    readings = iter([((500, 1000), 100), ((300, 1000), 150)])  # (mem_get_info, memory_reserved) before, after
    now: list = []

    def mem_get_info():
        now[:] = [next(readings)]
        return now[0][0]

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: now[0][1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("an unbounded device wait at init"))
    before = levels.nccl_memory_mark()
    # 200 bytes fewer free, 50 of them torch's caching allocator's (the warm-up's buffer): 150 are NCCL's
    assert before == (500, 100) and levels.nccl_memory_since(before) == 150
