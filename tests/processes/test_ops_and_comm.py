"""The custom ops (opcheck), the dc schemas, and the communicator seam's group context."""

import pytest
import torch

from owner_reduce.wiring import ops
from tests.support.fakes import MirrorComm


class _Recorder:
    def __init__(self):
        self.calls = []

    def reduce_grad(self, grad, graph_id, ds_id):
        self.calls.append(("reduce_grad", tuple(grad.shape), graph_id, ds_id))

    def end_backward(self, graph_id, release):
        self.calls.append(("end_backward", graph_id, release))


@pytest.fixture
def recorder():
    rec = _Recorder()
    ops.set_active_runtime(rec)
    yield rec
    ops.set_active_runtime(None)


def test_opcheck_reduce_grad(recorder):
    grad = torch.randn(3, 4)
    torch.library.opcheck(ops.REDUCE_GRAD, (grad, 7, 2))
    assert ("reduce_grad", (3, 4), 7, 2) in recorder.calls
    out = ops.REDUCE_GRAD(grad, 7, 2)
    assert out.numel() == 0 and out.dtype == grad.dtype


def test_opcheck_end_backward(recorder):
    torch.library.opcheck(ops.END_BACKWARD, ([torch.empty(0), None], 7, True))
    assert ("end_backward", 7, True) in recorder.calls


def test_end_backward_runs_without_any_tensor_dependency(recorder):
    # A graph whose reduce outputs were all nulled: CompositeExplicitAutograd still reaches the kernel.
    ops.END_BACKWARD([], 3, False)
    ops.END_BACKWARD([None], 4, True)
    assert recorder.calls == [("end_backward", 3, False), ("end_backward", 4, True)]


def test_ops_are_plain_library_ops_with_the_expected_schemas():
    """Not torch.library.custom_op (whose wrapper costs several times the dispatch); schemas as DeepCompile's."""
    from torch._library.custom_ops import OPDEFS

    assert "owner_reduce::reduce_grad" not in OPDEFS and "owner_reduce::end_backward" not in OPDEFS
    assert str(ops.REDUCE_GRAD._schema) == "owner_reduce::reduce_grad(Tensor grad, int graph_id, int ds_id) -> Tensor"
    assert str(ops.END_BACKWARD._schema) == ("owner_reduce::end_backward(Tensor?[] deps, int graph_id, "
                                             "bool release_reduce_buckets) -> ()")


def test_fake_kernels_keep_tracing_from_running_the_runtime(recorder):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        grad = mode.from_tensor(torch.randn(3))
        token = ops.REDUCE_GRAD(grad, 7, 2)
        ops.END_BACKWARD([token], 7, True)
    assert token.shape == (0,) and recorder.calls == []


def test_ops_without_runtime_fail_loudly():
    with pytest.raises(RuntimeError, match="no owner_reduce runtime is active"):
        ops.REDUCE_GRAD(torch.randn(2), 1, 1)
    with pytest.raises(RuntimeError, match="no owner_reduce runtime is active"):
        ops.END_BACKWARD([None], 1, False)


def test_dc_schemas_match_deepcompile():
    # Parse each schema as torch does; the names DeepCompile's inductor registration needs are all there.
    for name, schema in ops.DC_SCHEMAS.items():
        parsed = torch._C.parse_schema(f"dc::{schema}")
        assert parsed.name == f"dc::{name}"
    assert {"reduce_grad", "end_backward", "allgather_param", "wait_allgather", "release_param", "free_tensors",
            "offload_tensor", "wait_offload", "reload_tensor", "wait_reload"} <= set(ops.DC_SCHEMAS)


def test_group_context_closes_on_error():
    comm = MirrorComm(fail_on_call=1)
    buf = torch.ones(4)
    with pytest.raises(RuntimeError, match="injected"):
        with comm.group():
            comm.all_reduce(buf)
            comm.reduce(buf, 1)
    assert comm.open_groups == 0 and not comm.in_group
    with comm.group():  # usable again
        pass
    with pytest.raises(RuntimeError, match="nested"):
        with comm.group():
            with comm.group():
                pass
    assert comm.open_groups == 0


def test_reduce_scatter_default_is_one_reduce_per_block():
    from owner_reduce.runtime.comm import ReduceComm

    class ReducesOnly(MirrorComm):
        reduce_scatter = ReduceComm.reduce_scatter  # the seam's default, for a comm without a native one

    comm = ReducesOnly(rank=1, world_size=3)
    buf = torch.arange(6, dtype=torch.float32)
    with comm.group():
        comm.reduce_scatter(buf, 2)
    assert comm.calls == [("reduce", 0, 2), ("reduce", 1, 2), ("reduce", 2, 2)]
    assert buf[2:4].tolist() == [6.0, 9.0]
    with pytest.raises(ValueError, match="3 x 2 elements, the buffer has 5"):
        comm.reduce_scatter(torch.zeros(5), 2)


def _gloo_reduce_scatter_worker(rank, world_size):
    import torch.distributed as dist

    from owner_reduce.runtime.torch_comm import TorchDistComm

    comm = TorchDistComm(dist.group.WORLD)
    buf = torch.arange(3 * world_size, dtype=torch.float32) * (rank + 1)
    with comm.group():
        comm.reduce_scatter(buf, 3)
    return buf[3 * rank:3 * rank + 3].tolist()


@pytest.mark.timeout(120)
def test_torch_dist_reduce_scatter_over_gloo_in_place():
    from harness.launch import run_ranks

    results = run_ranks(_gloo_reduce_scatter_worker, 3, timeout=100)
    factor = 1 + 2 + 3
    assert results == [[factor * (3 * r + i) for i in range(3)] for r in range(3)]
