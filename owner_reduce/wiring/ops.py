"""The graph ops ``owner_reduce::reduce_grad`` / ``owner_reduce::end_backward``, and DeepCompile's ``dc`` schemas.

Why our own ops rather than DeepCompile's: the ``dc`` ops dispatch into whatever native library defined them;
ours dispatch into the active Python runtime, and the pass retargets DeepCompile's nodes to them. Each op
returns a fresh empty tensor / nothing and has a fake kernel, so tracing and inductor lowering never run it.

Note (inductor buffer reuse): inductor may plan a later kernel's output into the storage of a tensor whose
last reader was our op. The reducer may still read it (a copy on a side stream), so the lowering below
marks the op's inputs and outputs never-reuse, as DeepCompile does for ``dc.reduce_grad``.
"""

from __future__ import annotations

from typing import Any

import torch

_runtime: Any = None  # the active runtime; set by install while a DeepCompile engine uses it


def set_active_runtime(runtime: Any) -> None:
    global _runtime
    _runtime = runtime


def active_runtime_or_none() -> Any:
    return _runtime


def active_runtime() -> Any:
    if _runtime is None:
        raise _no_runtime()
    return _runtime


def _no_runtime() -> RuntimeError:
    return RuntimeError("owner_reduce: a reduce op ran but no owner_reduce runtime is active "
                        "(was the engine cleaned up, or compiled without owner_reduce.install()?)")


# Note (op kind): plain ``torch.library`` definitions (DEF + impl + register_fake), not ``custom_op``: the
# dispatcher reaches a Python kernel in 2-4 µs where ``custom_op``'s wrapper costs 11-17 µs, and reduce_grad
# runs once per gradient. CompositeExplicitAutograd reaches the kernel for any device (and for end_backward
# when ``deps`` holds no tensor); the fake kernels keep tracing and inductor from ever running the real one.
_lib = torch.library.Library("owner_reduce", "DEF")
_lib.define("reduce_grad(Tensor grad, int graph_id, int ds_id) -> Tensor")
_lib.define("end_backward(Tensor?[] deps, int graph_id, bool release_reduce_buckets) -> ()")


def _reduce_grad_kernel(grad: torch.Tensor, graph_id: int, ds_id: int) -> torch.Tensor:
    """Hand one parameter gradient to the runtime; returns an empty tensor (a dependency token)."""
    runtime = _runtime
    if runtime is None:
        raise _no_runtime()
    runtime.reduce_grad(grad, graph_id, ds_id)
    return grad.new_empty(0)


def _end_backward_kernel(deps: list[torch.Tensor | None], graph_id: int, release_reduce_buckets: bool) -> None:
    """Flush what this graph's backward left in the buckets; ``deps`` orders it after every reduce_grad."""
    active_runtime().end_backward(graph_id, release_reduce_buckets)


_lib.impl("reduce_grad", _reduce_grad_kernel, "CompositeExplicitAutograd")
_lib.impl("end_backward", _end_backward_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("owner_reduce::reduce_grad", lambda grad, graph_id, ds_id: grad.new_empty(0), lib=_lib)
torch.library.register_fake("owner_reduce::end_backward", lambda deps, graph_id, release_reduce_buckets: None,
                            lib=_lib)

REDUCE_GRAD = torch.ops.owner_reduce.reduce_grad.default
END_BACKWARD = torch.ops.owner_reduce.end_backward.default

# DeepCompile's op schemas (ops/csrc/compile/init.cpp, deepspeed 0.19.8). DeepCompile's passes and inductor
# registration name these ops; without the native extension, owner_reduce defines them so those names exist.
DC_SCHEMAS: dict[str, str] = {
    "allgather_param": "allgather_param(Tensor a, int graph_id, int id, ScalarType? dtype = None) -> Tensor",
    "prefetch_params_fused": "prefetch_params_fused(int graph_id, Tensor[] params, int[] ids, "
                             "ScalarType[]? dtypes = None) -> ()",
    "wait_allgather": "wait_allgather(Tensor(a) a, int graph_id, int id) -> Tensor(a)",
    "release_param": "release_param(Tensor(a) a, int graph_id, int id, int n_users) -> Tensor(a)",
    "reduce_grad": "reduce_grad(Tensor a, int graph_id, int id) -> Tensor",
    "free_tensors": "free_tensors(Tensor[] a) -> ()",
    "offload_tensor": "offload_tensor(Tensor a, int id, int id) -> Tensor",
    "reload_tensor": "reload_tensor(Tensor a, int id, int id) -> Tensor",
    "wait_offload": "wait_offload(Tensor a, int id, int id) -> Tensor",
    "wait_reload": "wait_reload(Tensor a, int id, int id) -> Tensor",
    "offload_parameter": "offload_parameter(Tensor a, int id, int id) -> ()",
    "reload_parameter": "reload_parameter(Tensor a, int id, int id) -> ()",
    "end_backward": "end_backward(Any deps, int graph_id, bool release_reduce_buckets) -> ()",
}

_dc_library: Any = None


def _dc_op_unavailable(name: str) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"owner_reduce: dc.{name} ran, but the native DeepCompile extension is not loaded; "
                           "owner_reduce's pass replaces dc.reduce_grad/dc.end_backward and supports ZeRO stage 1 "
                           "without ZeRO-3, offload or free_activation")

    return kernel


def ensure_dc_schemas() -> bool:
    """Define the ``dc`` op schemas if no library has; True if owner_reduce defined them."""
    global _dc_library
    if _dc_library is not None:
        return True
    if hasattr(torch.ops.dc, "reduce_grad"):
        missing = [name for name in DC_SCHEMAS if not hasattr(torch.ops.dc, name)]
        if missing:
            raise RuntimeError(f"owner_reduce: the loaded DeepCompile extension lacks dc ops {missing}")
        return False
    lib = torch.library.Library("dc", "DEF")
    for name, schema in DC_SCHEMAS.items():
        lib.define(schema)
        # CompositeExplicitAutograd reaches the kernel even when no argument is a tensor (end_backward's
        # `Any deps`); the fake kernels keep tracing from ever running the loud one.
        lib.impl(name, _dc_op_unavailable(name), "CompositeExplicitAutograd")
    torch.library.register_fake("dc::reduce_grad", lambda a, graph_id, id: a.new_empty(0), lib=lib)
    torch.library.register_fake("dc::end_backward", lambda deps, graph_id, release_reduce_buckets: None, lib=lib)
    torch.library.register_fake("dc::free_tensors", lambda a: None, lib=lib)
    _dc_library = lib
    return True


def release_dc_schemas() -> None:
    """Drop the ``dc`` schemas owner_reduce defined (torch allows one definition of a namespace per process)."""
    global _dc_library
    if _dc_library is not None:
        _dc_library._destroy()
        _dc_library = None


_lowered = False


def register_inductor_lowerings() -> None:
    """Lower both ops as fallback kernels whose buffers inductor never recycles (idempotent)."""
    global _lowered
    if _lowered:
        return
    import torch.utils._pytree as pytree
    from torch._inductor.ir import FallbackKernel, IRNode, TensorBox
    from torch._inductor.lowering import add_needs_realized_inputs, fallbacks, register_lowering
    from torch._inductor.virtualized import V

    def never_reuse(x: Any) -> Any:
        if isinstance(x, IRNode):
            V.graph.never_reuse_buffers.add(x.get_name())
        return x

    class NoReuseKernel(FallbackKernel):
        def __init__(self, op: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(op, *args, **kwargs)
            # The inputs are realized buffers by now (FallbackKernel realizes its tensor arguments).
            pytree.tree_map(never_reuse, args)

    def lowering(op: Any) -> Any:
        fallbacks.add(op)
        add_needs_realized_inputs(op)

        def handler(*args: Any, **kwargs: Any) -> Any:
            out = NoReuseKernel.create(op, *args, **kwargs)
            return pytree.tree_map(
                lambda x: never_reuse(TensorBox.create(x)) if isinstance(x, IRNode) else x, out)

        register_lowering(op, type_promotion_kind=None)(handler)

    lowering(REDUCE_GRAD)
    lowering(END_BACKWARD)
    _lowered = True
