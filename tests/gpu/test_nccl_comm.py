"""The cupy NCCL layer: dtype/op tables, error messages, the fallback decision and its agreement across ranks.

Without a GPU everything here runs against the real cupy and libnccl (both load on CPU): the unique-id
exchange over gloo is real, and so is the failure to create a communicator. Tests marked ``cuda`` run real
NCCL collectives and are skipped where torch sees no GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from harness.launch import run_ranks
from owner_reduce.planning.flush_plan import ALL
from owner_reduce.planning.owner_map import Placement
from owner_reduce.runtime import nccl_binding, nccl_comm
from owner_reduce.runtime.comm_select import FALLBACK_PREFIX, SelectSteps, combine_reasons, local_readiness, select_comm
from owner_reduce.runtime.torch_comm import TorchDistComm
from tests.support.fakes import MirrorComm, two_gpu_ranks_env

nccl = pytest.importorskip("cupy.cuda.nccl")
HAS_CUDA = torch.cuda.is_available()

# ---- tables and messages (in process) --------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "name"), [(torch.float32, "NCCL_FLOAT32"), (torch.float16, "NCCL_FLOAT16"),
                                             (torch.float64, "NCCL_FLOAT64"), (torch.int64, "NCCL_INT64"),
                                             (torch.int32, "NCCL_INT32"), (torch.int8, "NCCL_INT8"),
                                             (torch.uint8, "NCCL_UINT8")])
def test_dtype_table(dtype, name):
    assert nccl_binding.nccl_dtype(dtype) == getattr(nccl, name)


def test_bfloat16_maps_to_nccl_bfloat16():
    if not hasattr(nccl, "NCCL_BFLOAT16"):
        with pytest.raises(TypeError, match="bfloat16.*lacks NCCL_BFLOAT16"):
            nccl_binding.nccl_dtype(torch.bfloat16)
    else:
        assert nccl_binding.nccl_dtype(torch.bfloat16) == nccl.NCCL_BFLOAT16 != nccl.NCCL_FLOAT16


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.int16, torch.float8_e4m3fn])
def test_unmapped_dtypes_raise_type_error_naming_them(dtype):
    with pytest.raises(TypeError, match=rf"torch\.{str(dtype).removeprefix('torch.')}"):
        nccl_binding.nccl_dtype(dtype)


def test_op_table():
    assert nccl_binding.nccl_op("sum") == nccl_binding.nccl_op("SUM") == nccl.NCCL_SUM
    with pytest.raises(ValueError, match="'avg'"):
        nccl_binding.nccl_op("avg")


def test_versions():
    assert nccl_binding.version_tuple(23203) == (2, 32, 3)
    assert nccl_binding.version_tuple(2708) == (2, 7, 8)
    major, minor, _ = nccl_binding.nccl_runtime_version()  # the real libnccl, loaded without a GPU
    assert (major, minor) >= (2, 0)


def test_unique_id_is_128_bytes():
    uid = nccl_binding.new_unique_id()
    assert isinstance(uid, bytes) and len(uid) == nccl_binding.UNIQUE_ID_BYTES == 128
    assert uid != nccl_binding.new_unique_id()


def test_failure_names_call_rank_and_cause():
    error = nccl_binding.failure("reduce(root=3, count=10, dtype=bfloat16)", 1, nccl.NcclError(2))
    assert isinstance(error, RuntimeError)
    assert str(error).startswith("owner_reduce NCCL reduce(root=3, count=10, dtype=bfloat16) failed on rank 1: "
                                 "NcclError: NCCL_ERROR_SYSTEM_ERROR")


def test_constructor_checks_arguments():
    with pytest.raises(ValueError, match="128 bytes"):
        nccl_comm.CupyNcclComm(b"x" * 5, 0, 1)
    with pytest.raises(ValueError, match="rank 2 outside"):
        nccl_comm.CupyNcclComm(bytes(128), 2, 2)


@pytest.mark.skipif(HAS_CUDA, reason="checks the failure without a GPU")
def test_creation_without_gpu_raises_runtime_error_naming_rank():
    with pytest.raises(RuntimeError, match=r"owner_reduce NCCL communicator creation \(world_size=1, rank=0.*"
                                           r"failed on rank 0: "):
        nccl_comm.CupyNcclComm(nccl_binding.new_unique_id(), 0, 1)


# ---- the decision, in process ------------------------------------------------------------------------------


def test_combine_reasons():
    assert combine_reasons([None, None]) is None
    assert combine_reasons([]) is None
    assert combine_reasons(["no gpu", "no gpu"]) == "all ranks: no gpu"
    assert combine_reasons([None, "no cupy", None, "no cupy"]) == "ranks 1, 3: no cupy"
    assert combine_reasons([None] + ["no cupy"] * 511) == "ranks 1-511: no cupy"  # folded at scale
    assert combine_reasons(["a", None, "b"]) == "rank 0: a; rank 2: b"


class _Built(MirrorComm):
    """A communicator ``select_comm`` builds or falls back to: it may close one, never issue a call on it."""

    name = "built"

    def __init__(self, rank: int = 0) -> None:
        super().__init__(rank, 2, fail_on_call=0)  # any collective raises
        self.closed = 0

    def all_gather_ints(self, values):  # pragma: no cover - never called
        raise AssertionError

    def close(self):
        self.closed += 1


class _Staged:
    """Rank ``rank`` of 2 whose peer's reasons are scripted: what each gather returns, in order."""

    def __init__(self, rank, peer_reasons, readiness=None, create_error=None):
        self.rank = rank
        self.peer_reasons = list(peer_reasons)
        self.built: list[_Built] = []
        self.gathers: list[list[str | None]] = []
        self.fallback = _Built(rank)
        self.steps = SelectSteps(readiness=lambda: readiness, create=self._create, gather=self._gather,
                                 fallback=lambda pg: self.fallback)
        self.create_error = create_error

    def _create(self, pg):
        if self.create_error:
            raise RuntimeError(self.create_error)
        self.built.append(_Built(self.rank))
        return self.built[-1]

    def _gather(self, pg, reason):
        row = [reason, self.peer_reasons.pop(0)] if self.rank == 0 else [self.peer_reasons.pop(0), reason]
        self.gathers.append(row)
        return row


@pytest.fixture
def warnings(monkeypatch):
    from deepspeed.utils import logger

    seen: list[str] = []
    monkeypatch.setattr(logger, "warning", seen.append)
    return seen


def test_all_ready_and_built_uses_the_built_comm(warnings):
    staged = _Staged(0, [None, None])
    comm = select_comm(None, staged.steps)
    assert comm is staged.built[0] and comm.closed == 0
    assert warnings == []


def test_peer_not_ready_falls_back_before_anyone_creates(warnings):
    staged = _Staged(0, ["cupy's NCCL binding is unavailable (ImportError: no cupy)"])
    assert select_comm(None, staged.steps) is staged.fallback
    assert staged.built == [] and len(staged.gathers) == 1
    assert warnings == [f"{FALLBACK_PREFIX}: cupy NCCL cannot be used: rank 1: cupy's NCCL binding is unavailable "
                        "(ImportError: no cupy)"]


def test_peer_creation_failure_closes_what_this_rank_built(warnings):
    staged = _Staged(0, [None, "RuntimeError: owner_reduce NCCL communicator creation failed on rank 1: boom"])
    assert select_comm(None, staged.steps) is staged.fallback
    assert len(staged.built) == 1 and staged.built[0].closed == 1
    assert len(warnings) == 1 and "creating the cupy NCCL communicator failed: rank 1: RuntimeError" in warnings[0]


def test_only_group_rank_0_warns(warnings):
    staged = _Staged(1, [None, None], create_error="boom")
    assert select_comm(None, staged.steps) is staged.fallback
    assert warnings == [] and staged.gathers[-1] == [None, "RuntimeError: boom"]


def test_a_readiness_check_that_raises_is_a_reason(warnings):
    def broken():
        raise OSError("disk on fire")

    staged = _Staged(0, [None])
    steps = SelectSteps(readiness=broken, create=staged.steps.create, gather=staged.steps.gather,
                        fallback=staged.steps.fallback)
    assert select_comm(None, steps) is staged.fallback
    assert warnings == [f"{FALLBACK_PREFIX}: cupy NCCL cannot be used: rank 0: OSError: disk on fire"]


def test_local_readiness_on_cpu_names_the_accelerator():
    assert local_readiness("cpu") == "the DeepSpeed accelerator is 'cpu', not 'cuda'"
    if not HAS_CUDA:
        assert local_readiness("cuda") == "torch sees no CUDA device"


# ---- across real ranks (gloo, spawned) -----------------------------------------------------------------------


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _ready() -> str | None:
    return None


_CREATE_CALLS: list[int] = []


def _recording_create(pg):
    _CREATE_CALLS.append(1)
    raise AssertionError("create must not run when a peer is not ready")


def _select_and_reduce(steps: SelectSteps | None, block_cupy: bool) -> dict:
    """select_comm under a warning capture, then one all_reduce through what it returned."""
    import torch.distributed as dist
    from deepspeed.utils import logger

    saved = {name: sys.modules.get(name) for name in ("cupy", "cupy.cuda", "cupy.cuda.nccl")}
    capture = _Capture()
    logger.addHandler(capture)
    try:
        if block_cupy:
            sys.modules.update(dict.fromkeys(saved))  # None: "import cupy" raises ImportError
        comm = select_comm(dist.group.WORLD, steps)
    finally:
        logger.removeHandler(capture)
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    buf = torch.full((5,), float(dist.get_rank() + 1))
    with comm.group():
        comm.all_reduce(buf)
    comm.close()
    return {"comm": type(comm).__name__, "warnings": capture.lines, "sum": buf.tolist()}


def _scenarios(rank: int, world_size: int, without_gpu: bool) -> dict:
    import torch.distributed as dist

    out = {"uid": nccl_binding.exchange_unique_id(dist.group.WORLD)}
    if without_gpu:
        # The DeepSpeed accelerator is the CPU one here: the default steps fall back at once.
        out["cpu_accelerator"] = _select_and_reduce(None, block_cupy=False)
        # Both ranks ready (forced): the unique id is exchanged and the real communicator creation fails.
        out["creation_fails"] = _select_and_reduce(SelectSteps(readiness=_ready), block_cupy=False)
    # Rank 1 cannot import cupy; rank 0 says it is ready: nobody creates, both fall back.
    readiness = _ready if rank == 0 else functools.partial(local_readiness, "cuda")
    out["peer_without_cupy"] = _select_and_reduce(SelectSteps(readiness=readiness, create=_recording_create),
                                                  block_cupy=rank == 1)
    out["create_calls"] = len(_CREATE_CALLS)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_scenarios, 2, args=(not HAS_CUDA,), timeout=150)


@pytest.mark.timeout(200)
def test_unique_id_exchange_over_gloo(two_ranks):
    uids = [r["uid"] for r in two_ranks]
    assert all(isinstance(u, bytes) and len(u) == 128 for u in uids)
    assert uids[0] == uids[1] and any(uids[0])


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("scenario", "cause"), [
    ("cpu_accelerator", "cupy NCCL cannot be used: all ranks: the DeepSpeed accelerator is 'cpu', not 'cuda'"),
    # Without a GPU the device cannot be resolved on either rank: the agreed step before ncclCommInitRank
    # stops every rank before any of them blocks in it, naming each rank's cause (one cause for both ranks: grouped).
    ("creation_fails", "creating the cupy NCCL communicator failed: all ranks: RuntimeError: owner_reduce: not "
                       "creating the NCCL communicator: ranks 0, 1: "),
    ("peer_without_cupy", "cupy NCCL cannot be used: rank 1: cupy's NCCL binding is unavailable (ModuleNotFoundError"),
])
def test_fallback_is_agreed_warned_once_and_results_unchanged(two_ranks, scenario, cause):
    if scenario != "peer_without_cupy" and HAS_CUDA:
        pytest.skip("the CPU accelerator and the failing creation are what a machine without GPU has")
    r0, r1 = (r[scenario] for r in two_ranks)
    assert r0["comm"] == r1["comm"] == TorchDistComm.__name__
    assert r1["warnings"] == [] and len(r0["warnings"]) == 1, (r0["warnings"], r1["warnings"])
    assert r0["warnings"][0].startswith(f"{FALLBACK_PREFIX}: ")
    assert cause in r0["warnings"][0], r0["warnings"][0]
    assert r0["sum"] == r1["sum"] == [3.0] * 5
    assert [r["create_calls"] for r in two_ranks] == [0, 0]


# ---- real NCCL (GPU only) -----------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.timeout(120)
def test_one_rank_collectives(dtype):
    comm = nccl_comm.CupyNcclComm(nccl_binding.new_unique_id(), 0, 1)
    try:
        buf = torch.arange(10, device="cuda", dtype=dtype)
        expected = buf.clone()
        with comm.group():
            comm.reduce(buf[:4], 0)
            comm.all_reduce(buf[4:])
        torch.testing.assert_close(buf, expected, rtol=0, atol=0)
        assert comm.all_gather_ints([3, 4]) == [[3, 4]]
        with pytest.raises(ValueError, match="contiguous"):
            comm.all_reduce(torch.zeros(4, 4, device="cuda", dtype=dtype).t())
        with pytest.raises(ValueError, match="buffer on cpu"):
            comm.all_reduce(torch.zeros(4, dtype=dtype))
        with pytest.raises(TypeError, match="complex64"):
            comm.all_reduce(torch.zeros(4, device="cuda", dtype=torch.complex64))
    finally:
        comm.close()
        comm.close()



def _two_rank_gpu_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    comm = select_comm(dist.group.WORLD)  # the real decision: CUDA accelerator, cupy, GPU
    out: dict = {"comm": type(comm).__name__}
    for dtype in (torch.float32, torch.bfloat16):
        buf = torch.full((1000,), float(rank + 1), device="cuda", dtype=dtype)
        with comm.group():
            comm.reduce(buf[:300], 1)
            comm.all_reduce(buf[300:700])
            comm.reduce(buf[700:], 0)
        torch.cuda.synchronize()
        out[str(dtype)] = buf.cpu().float()
    out["gathered"] = comm.all_gather_ints([rank, 10 + rank])
    comm.close()
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.timeout(240)
def test_two_rank_reduce_and_all_reduce():
    r0, r1 = run_ranks(_two_rank_gpu_worker, 2, timeout=200, env=two_gpu_ranks_env())
    assert r0["comm"] == r1["comm"] == "CupyNcclComm"
    for dtype in ("torch.float32", "torch.bfloat16"):
        assert r1[dtype][:300].eq(3).all() and r0[dtype][700:].eq(3).all()
        assert r0[dtype][300:700].eq(3).all() and r1[dtype][300:700].eq(3).all()
    assert r0["gathered"] == r1["gathered"] == [[0, 10], [1, 11]]


def _two_rank_reduce_scatter_worker(rank: int, world_size: int) -> dict:
    """A flush as the runtime issues a hand-off: one group with the in-place ReduceScatter (and an AllReduce), then
    one group of sends and receives (each rank sends the first 100 elements of its reduced block to the other,
    which receives them in place)."""
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    comm = select_comm(dist.group.WORLD)
    out: dict = {"comm": type(comm).__name__}
    other = 1 - rank
    for dtype in (torch.float32, torch.bfloat16):
        buf = torch.arange(2 * 500, device="cuda", dtype=torch.float32).to(dtype) * (rank + 1)
        tail = torch.full((100,), float(rank + 1), device="cuda", dtype=dtype)
        with comm.group(flush=1):
            comm.reduce_scatter(buf, 500)  # in place: this rank's block receives its sum
            comm.all_reduce(tail)
        block = buf[500 * rank:500 * (rank + 1)].clone()
        with comm.group(flush=1):
            comm.send(buf[500 * rank:500 * rank + 100], other)
            comm.recv(buf[500 * other:500 * other + 100], other)
        torch.cuda.synchronize()
        out[str(dtype)] = (block.cpu().float(), tail.cpu().float(), buf[500 * other:500 * other + 100].cpu().float())
    comm.close()
    return out


def _scaled_arange(start: int, stop: int, dtype: str) -> torch.Tensor:
    """What rank 0's and rank 1's ``arange * (rank + 1)`` sum to, in ``dtype``, as float32."""
    return torch.arange(start, stop, dtype=torch.float32).to(getattr(torch, dtype[6:])).float() * 3


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.timeout(240)
def test_two_rank_reduce_scatter_in_place_then_handoff():
    results = run_ranks(_two_rank_reduce_scatter_worker, 2, timeout=200, env=two_gpu_ranks_env())
    for rank, r in enumerate(results):
        assert r["comm"] == "CupyNcclComm"
        other = 1 - rank
        for dtype in ("torch.float32", "torch.bfloat16"):
            block, tail, received = r[dtype]
            torch.testing.assert_close(block, _scaled_arange(500 * rank, 500 * (rank + 1), dtype), rtol=0, atol=0)
            assert tail.eq(3).all()
            torch.testing.assert_close(received, _scaled_arange(500 * other, 500 * other + 100, dtype), rtol=0,
                                       atol=0)


# ---- DLPack views: made without any stream synchronization (torch's real __dlpack__, fake CUDA) -----------------
# These fakes stay: they run torch's own Tensor.__dlpack__ stream logic, which the simulated device replaces by its own.


class _CountingCuda:
    """What torch's ``Tensor.__dlpack__`` asks of ``torch.cuda``, counted: a current stream (the reduce stream or
    the default stream), events recorded and stream waits."""

    def __init__(self, current: str) -> None:
        self.streams = {name: _NamedStream(self, name) for name in ("default", "reduce")}
        self.current = self.streams[current]
        self.events: list[str] = []  # "recorded on <stream>"
        self.waits: list[str] = []  # "<stream> waits"

    def current_device(self) -> int:
        return 0

    def current_stream(self, device=None):
        return self.current

    def default_stream(self, device=None):
        return self.streams["default"]

    def ExternalStream(self, ptr, device=None):  # noqa: N802 - torch.cuda's name
        return _NamedStream(self, f"external {ptr:#x}")

    def Event(self):  # noqa: N802 - torch.cuda's name
        cuda = self

        class _Event:
            def record(self, stream):
                cuda.events.append(f"recorded on {stream.name}")

        return _Event()


class _NamedStream:
    def __init__(self, cuda: _CountingCuda, name: str) -> None:
        self._cuda, self.name = cuda, name

    def wait_event(self, event) -> None:
        self._cuda.waits.append(f"{self.name} waits")


class _CudaBuffer:
    """A CUDA bucket buffer as far as ``_view_of`` and torch's own ``Tensor.__dlpack__`` (the real function, bound
    to this object) go: device, dtype, layout, sizes; ``__dlpack__`` runs torch 2.13's stream logic unchanged."""

    __dlpack__ = torch.Tensor.__dlpack__
    device = torch.device("cuda", 0)
    dtype = torch.float32
    layout = torch.strided
    requires_grad = False

    def is_conj(self) -> bool:
        return False

    def detach(self):
        return self

    def view(self, dtype):
        return self

    def element_size(self) -> int:
        return 4

    def storage_offset(self) -> int:
        return 0

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0


class _Cupy14:
    """cupy 14.2's ``from_dlpack`` as a consumer (cupy/_core/dlpack.pyx): given an object with ``__dlpack_device__``
    it passes its current stream (the legacy default stream: 1, as cupy's current stream is 0 unless set); given a
    capsule it takes it as is."""

    def from_dlpack(self, array):
        if hasattr(array, "__dlpack_device__"):
            array.__dlpack__(stream=1, max_version=(1, 0), copy=None)
        return types.SimpleNamespace(device=types.SimpleNamespace(id=0), data=types.SimpleNamespace(ptr=0x7000))


def _export(capsules: list, kind: str, tensor, *, dl_device=None, copy=None, **versioned) -> object:
    """torch._C's DLPack export, recorded: ``_to_dlpack(t, dl_device=, copy=)`` (unversioned) and
    ``_to_dlpack_versioned(t, dl_device=, copy=)``, which torch 2.14 and later also pass ``read_only=`` (the versioned
    protocol's flags). An unknown keyword fails here, as it would in torch."""
    unknown = set(versioned) - ({"read_only"} if kind == "versioned" else set())
    if unknown:
        raise TypeError(f"_to_dlpack ({kind}): unexpected keyword {sorted(unknown)}")
    capsules.append((kind, {"dl_device": dl_device, "copy": copy, **versioned}))
    return object()


@pytest.mark.parametrize("current", ["reduce", "default"])
def test_dlpack_views_add_no_event_and_no_stream_wait(monkeypatch, current):
    """Views are made again after every bucket release (every step of a one-graph model): making them must not make
    the default stream (the backward's compute) wait for the reduce stream, whichever stream torch has current."""
    cuda = _CountingCuda(current)
    for name in ("current_device", "current_stream", "default_stream", "ExternalStream", "Event"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    capsules: list[tuple[str, dict]] = []
    monkeypatch.setattr(torch._C, "_to_dlpack", functools.partial(_export, capsules, "unversioned"))
    monkeypatch.setattr(torch._C, "_to_dlpack_versioned", functools.partial(_export, capsules, "versioned"))
    comm = object.__new__(nccl_comm.CupyNcclComm)
    comm.rank, comm.device, comm._views = 0, 0, {}
    comm._cupy = _Cupy14()
    for _ in range(3):  # three steps, the buckets released (and the views dropped) after each
        buffers = [_CudaBuffer(), _CudaBuffer()]
        views = [comm._view_of(b, "reduce(root=1, count=4, dtype=float32)") for b in buffers]
        assert [v.ptr for v in views] == [0x7000, 0x7000] and len(comm._views) == 2
        comm.release_buffers()
    # torch's __dlpack__ ran to its end for every view; without max_version it exports the unversioned capsule
    # (DLPack 0.8, no flags field, so never read-only: NCCL writes the buffer in place), which cupy 14 takes as is.
    assert capsules == [("unversioned", {"dl_device": None, "copy": None})] * 6
    assert cuda.events == [] and cuda.waits == []
    # Negative control: handing cupy the tensor itself (cupy then passes its stream) is what the counters catch.
    _Cupy14().from_dlpack(_CudaBuffer())
    kind, kwargs = capsules[-1]  # cupy asks for DLPack 1.0: the versioned capsule, writable (read_only off, 2.14+)
    assert kind == "versioned" and kwargs.get("read_only", False) is False
    if current == "reduce":
        assert cuda.events == ["recorded on reduce"] and cuda.waits == ["default waits"]
    else:  # the default stream is current: torch sees the same stream and synchronizes nothing
        assert cuda.events == [] and cuda.waits == []


# ---- scripts/nccl_check.py: its layout, and its answer without a GPU ----------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def nccl_check():
    spec = importlib.util.spec_from_file_location("nccl_check", ROOT / "scripts" / "nccl_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nccl_check_layout_is_zero1s(nccl_check):
    # DESIGN.md's shares for GPT-2 124M under ZeRO-1's partition arithmetic: 60.5% single-owner at ws=8, 5.8% at 64.
    numels = nccl_check.gpt2_param_numels()
    assert sum(numels) == 124_439_808
    for ws, share in ((8, 60.5), (64, 5.8)):
        owner_map = nccl_check.zero1_owner_map(numels, ws)
        one = sum(p.numel for p in owner_map if p.placement is Placement.ONE_OWNER)
        assert round(100 * one / sum(numels), 1) == share


@pytest.mark.parametrize("ws", [2, 4, 8])
def test_nccl_check_bucket_spans_a_partition_boundary(nccl_check, ws):
    plan = nccl_check.plan_bucket(ws, 32 * 2**20, 4)
    assert len({r.root for r in plan.ranges if r.root is not ALL}) >= 2  # at least two owners receive
    assert plan.reduced_elems <= 32 * 2**20 // 4 and 0 < plan.owner_elems <= plan.reduced_elems
    assert sum(r.count for r in plan.ranges) == plan.reduced_elems
    # adjacent same-root ranges are merged
    assert all(a.root != b.root for a, b in zip(plan.ranges, plan.ranges[1:], strict=False))


@pytest.mark.skipif(HAS_CUDA, reason="checks the answer without a GPU")
def test_nccl_check_without_gpu_says_so_and_exits_3():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "nccl_check.py")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stderr
    assert "no CUDA GPU is visible" in done.stdout


def test_send_recv_peer_is_checked():
    comm = object.__new__(nccl_comm.CupyNcclComm)
    comm.rank, comm.world_size = 1, 4
    for peer in (1, 4, -1):
        with pytest.raises(ValueError, match=f"peer {peer} on rank 1 must be another rank of 0..3"):
            comm._check_peer(peer)
