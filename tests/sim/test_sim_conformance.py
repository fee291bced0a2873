"""The simulated device against the real stack it stands for (issue 46, finding 8): cupy 14's NCCL binding, read from
the installed wheel (it imports without a GPU), and torch's ``Tensor.__dlpack__``.

- Signatures: every ``NcclCommunicator`` method, module function and constant of cupy the product touches (found in
  its source) has, in the sim, the binding's name, parameter names and order, defaults and C types (a Cython
  builtin's signature is the first line of its ``__doc__``: ``NcclCommunicator.reduce(self, intptr_t sendbuf, ...)``);
  every method the sim offers exists in the binding alike.
- Argument conversion: the same argument vectors (wrong types, values out of a C type's range, floats and tensors
  where a C ``int`` truncates them, arity and keywords) go through the binding, on an instance made without
  ``__init__`` (cupy's NULL handle: a call that converts reaches NCCL, which refuses the NULL communicator with
  ``ncclInvalidArgument`` before any CUDA work; the constructor is only given vectors that fail before
  ``ncclCommInitRank``), and through the sim: each raises the same exception type (and NCCL status) in both, so the
  sim follows cupy when cupy changes.
- ``abort()``/``destroy()`` never raise (``nccl.pyx`` declares them ``void``): the sim refuses to inject a failing one.
- ``SimTensor.__dlpack__`` has torch's keyword-only signature and checks.

The sim puts its own modules under cupy's names in ``sys.modules`` while a ``Sim`` is installed: the real ones are
read here outside any Sim, from ``cupy_backends.cuda.libs.nccl`` (the binding, which the sim never replaces;
``cupy.cuda.nccl`` loads its libnccl first)."""

from __future__ import annotations

import ast
import decimal
import fractions
import importlib
import inspect
import pathlib
import re
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.sim import cuda as sim_cuda
from tests.support.sim import nccl as sim_nccl
from tests.support.sim.cuda import Sim, SimError, SimTensor

ROOT = pathlib.Path(__file__).resolve().parents[2]
PRODUCT_CUPY_MODULES = ("owner_reduce/runtime/nccl_binding.py", "owner_reduce/runtime/nccl_comm.py",
                        "owner_reduce/runtime/comm_select.py")
# what the product must be found calling (a scan that finds nothing would compare nothing)
KNOWN_CALLS = {"NcclCommunicator", "reduce", "allReduce", "reduceScatter", "allGather", "send", "recv", "abort",
               "destroy", "check_async_error", "groupStart", "groupEnd", "get_unique_id", "get_version",
               "from_dlpack", "Device", "getDevice", "NCCL_SUM", "NCCL_FLOAT32", "NCCL_BFLOAT16", "available"}
SIM_ONLY = {"member"}  # the sim's handle for tests (``comm.member``): not cupy's


def _binding() -> types.SimpleNamespace:
    """cupy's own objects, read outside any Sim."""
    assert sim_cuda._ACTIVE is None, "the real binding must be read outside a Sim"
    pytest.importorskip("cupy.cuda.nccl", reason="cupy (owner_reduce's cu12 extra) is missing")  # loads libnccl
    nccl = importlib.import_module("cupy_backends.cuda.libs.nccl")
    cupy = importlib.import_module("cupy")
    assert cupy.cuda.nccl.NcclCommunicator is nccl.NcclCommunicator, "cupy.cuda.nccl is not cupy's own here"
    return types.SimpleNamespace(nccl=nccl, cupy=cupy, runtime=cupy.cuda.runtime, device=cupy.cuda.Device)


def _sim_modules() -> types.SimpleNamespace:
    modules = sim_nccl.make_modules()  # what a Sim installs, built without installing it
    return types.SimpleNamespace(nccl=modules["cupy.cuda.nccl"], cupy=modules["cupy"],
                                 runtime=modules["cupy.cuda.runtime"], device=modules["cupy"].cuda.Device)


# ---- signatures ------------------------------------------------------------------------------------------------

_DOC_LINE = re.compile(r"(?:\w+\.)?(?P<name>\w+)\((?P<params>.*)\)(?: -> [\w.]+)?")
_DOC_PARAM = re.compile(r"(?:(?P<ctype>\w+) )?(?P<name>\w+)(?:=(?P<default>.+))?")


def doc_signature(obj: Any) -> list[tuple[str, str | None, str | None, bool]]:
    """A Cython builtin's parameters from the first line of its ``__doc__`` (``self`` left out): (name, C type or
    None for a Python object, default as written or None, keyword-only)."""
    line = (obj.__doc__ or "").strip().splitlines()[0]
    match = _DOC_LINE.fullmatch(line)
    assert match, f"no signature on the first line of {obj!r}'s doc: {line!r}"
    params, keyword_only = [], False
    for part in filter(None, (p.strip() for p in match["params"].split(","))):
        if part == "*":
            keyword_only = True
            continue
        param = _DOC_PARAM.fullmatch(part)
        assert param, f"{obj!r}: cannot read the parameter {part!r}"
        if param["name"] != "self":
            params.append((param["name"], param["ctype"], param["default"], keyword_only))
    return params


def sim_signature(fn: Callable[..., Any]) -> list[tuple[str, str | None, str | None, bool]]:
    """The same for a sim function (its annotations name the C types: ``sim_nccl.cython_args``)."""
    params = []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self":
            continue
        ctype = p.annotation if isinstance(p.annotation, str) else None
        default = None if p.default is inspect.Parameter.empty else repr(p.default)
        params.append((p.name, ctype, default, p.kind is inspect.Parameter.KEYWORD_ONLY))
    return params


def signature_differences(what: str, real: Any, sim: Callable[..., Any]) -> list[str]:
    """How ``sim``'s signature departs from the binding's ``real``: names, order, defaults, keyword-only, and the C
    type of every C-typed parameter (a Python-object parameter's annotation is the sim's own business)."""
    theirs, ours = doc_signature(real), sim_signature(sim)
    if [(n, d, k) for n, _, d, k in theirs] != [(n, d, k) for n, _, d, k in ours]:
        return [f"{what}: cupy takes {theirs}, the sim {ours}"]
    return [f"{what}: parameter {name!r} is {ctype} in cupy, {mine!r} in the sim"
            for (name, ctype, _, _), (_, mine, _, _) in zip(theirs, ours, strict=True)
            if ctype is not None and ctype != mine]


def product_cupy_names(real: types.SimpleNamespace) -> set[str]:
    """Every name of cupy's surface (the binding's module and communicator, ``cupy.from_dlpack``, ``cupy.cuda.Device``,
    ``cupy.cuda.runtime``) that the product's source reads, as an attribute or a string (``getattr(nccl, name)``).
    A superset of what it calls (``broadcast`` is also torch.distributed's), never less."""
    surface = ({n for n in dir(real.nccl) if not n.startswith("_")}
               | {n for n in dir(real.nccl.NcclCommunicator) if not n.startswith("_")}
               | {n for n in dir(real.runtime) if not n.startswith("_")} | {"from_dlpack", "Device"})
    found: set[str] = set()
    for path in PRODUCT_CUPY_MODULES:
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.Attribute) and node.attr in surface:
                found.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in surface:
                found.add(node.value)
    return found


def surface_differences(real: types.SimpleNamespace, sim: types.SimpleNamespace,
                        names: set[str]) -> list[str]:
    """Each name of ``names`` in the binding against the sim: signatures, constants' values."""
    problems: list[str] = []
    methods = {n for n in dir(real.nccl.NcclCommunicator) if not n.startswith("_")}
    for name in sorted(names):
        if name == "NcclCommunicator":
            problems += signature_differences(name, real.nccl.NcclCommunicator, sim.nccl.NcclCommunicator.__init__)
        elif name in methods:
            ours = getattr(sim.nccl.NcclCommunicator, name, None)
            if ours is None:
                problems.append(f"NcclCommunicator.{name}: missing from the sim")
            else:
                problems += signature_differences(f"NcclCommunicator.{name}", getattr(real.nccl.NcclCommunicator, name),
                                                  ours)
        elif name == "from_dlpack":
            problems += signature_differences(name, real.cupy.from_dlpack, sim.cupy.from_dlpack)
        elif name == "Device":
            problems += signature_differences(name, real.device, sim.device.__init__)
        elif hasattr(real.nccl, name) or hasattr(real.runtime, name):
            home, mine = (real.nccl, sim.nccl) if hasattr(real.nccl, name) else (real.runtime, sim.runtime)
            theirs, ours = getattr(home, name), getattr(mine, name, None)
            if ours is None:
                problems.append(f"{home.__name__}.{name}: missing from the sim")
            elif name == "NcclError":
                problems += signature_differences(name, theirs.__init__, ours.__init__)
            elif isinstance(theirs, int):
                if type(ours) is not type(theirs) or (name.startswith("NCCL_") and ours != theirs):
                    problems.append(f"{name}: {theirs!r} in cupy, {ours!r} in the sim")
            elif callable(theirs):
                problems += signature_differences(f"{home.__name__}.{name}", theirs, ours)
    return problems


def test_the_sims_cupy_surface_has_the_bindings_signatures_for_everything_the_product_uses():
    real, sim = _binding(), _sim_modules()
    names = product_cupy_names(real)
    assert KNOWN_CALLS <= names, f"the scan of {PRODUCT_CUPY_MODULES} missed {sorted(KNOWN_CALLS - names)}"
    assert surface_differences(real, sim, names) == []


def test_every_method_the_sims_communicator_offers_is_cupys_with_its_signature():
    real, sim = _binding(), _sim_modules()
    offered = {n for n, v in vars(sim_nccl.NcclCommunicator).items()
               if not n.startswith("_") and callable(v)} - SIM_ONLY
    assert offered >= {"reduce", "allReduce", "reduceScatter", "allGather", "send", "recv", "abort", "destroy"}
    functions = {n for n, v in vars(sim.nccl).items() if not n.startswith("_") and callable(v)}
    assert surface_differences(real, sim, offered | functions) == []


def _annotated(fn: Callable[..., Any], **ctypes: str) -> Callable[..., Any]:
    fn.__annotations__ = dict(ctypes)
    return fn


def test_negative_control_a_sim_signature_that_differs_from_cupys_is_caught(monkeypatch):
    """Two reduces the sim never had: ``root`` after ``stream``; then the right order with wrong C types."""
    real, sim = _binding(), _sim_modules()

    def swapped(self, sendbuf, recvbuf, count, datatype, op, stream, root):
        raise AssertionError("never called")

    def mistyped(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        raise AssertionError("never called")

    c_types = {"sendbuf": "intptr_t", "recvbuf": "intptr_t", "count": "size_t", "datatype": "int", "op": "int"}
    monkeypatch.setattr(sim_nccl.NcclCommunicator, "reduce",
                        _annotated(swapped, **c_types, stream="intptr_t", root="int"))
    problems = surface_differences(real, sim, {"reduce", "allReduce"})
    assert len(problems) == 1 and problems[0].startswith("NcclCommunicator.reduce: cupy takes [('sendbuf', ")
    monkeypatch.setattr(sim_nccl.NcclCommunicator, "reduce",
                        _annotated(mistyped, **{**c_types, "count": "intptr_t"}, root="intptr_t", stream="int"))
    assert surface_differences(real, sim, {"reduce"}) == [
        "NcclCommunicator.reduce: parameter 'count' is size_t in cupy, 'intptr_t' in the sim",
        "NcclCommunicator.reduce: parameter 'root' is int in cupy, 'intptr_t' in the sim",
        "NcclCommunicator.reduce: parameter 'stream' is intptr_t in cupy, 'int' in the sim"]


# ---- argument conversion -------------------------------------------------------------------------------------


class _Index:
    """Has ``__index__`` only: a C int of cupy's refuses it."""

    def __index__(self) -> int:
        return 3


class _Int:
    """Has ``__int__`` only: a C int of cupy's takes it."""

    def __int__(self) -> int:
        return 3


class _Bytes(bytes):
    pass


PROBES: tuple[Any, ...] = (
    1.5, -1.5, -0.5, True, None, "1", b"1", 1j, float("nan"), float("inf"), 1e30, np.int64(3), np.float64(3.0),
    np.uint64(2**64 - 1), torch.tensor(3), torch.tensor(3.5), _Index(), _Int(), decimal.Decimal(3),
    fractions.Fraction(7, 2), -1, -(2**31) - 1, 2**31, 2**32, 2**63, -(2**63) - 1, 2**64)
VALID = {"intptr_t": 0, "size_t": 1, "int": 0}  # NULL pointers and stream 0 are fine: NCCL refuses the NULL handle
SHORT_ID = b"x" * 10  # a commId the constructor refuses before ncclCommInitRank (never a 128-byte one)


def outcome(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, int | None]:
    """What a call does: ("returned", None) or (the exception's type name, its NCCL status where it has one)."""
    try:
        fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - what the call raised is the outcome compared
        return type(error).__name__, getattr(error, "status", None)
    return "returned", None


def method_vectors(real_method: Any) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """For a method of the binding: every C-typed parameter given every probe (the others valid), then arity and
    keywords."""
    params = doc_signature(real_method)
    valid = [VALID[ctype] for _, ctype, _, _ in params]
    for i in range(len(params)):
        for probe in PROBES:
            yield (*valid[:i], probe, *valid[i + 1:]), {}
    yield tuple(valid), {}
    yield (*valid, 0), {}
    if valid:
        yield tuple(valid[:-1]), {}
        yield (), {name: v for (name, _, _, _), v in zip(params, valid, strict=True)}
        yield tuple(valid[:-1]), {params[-1][0]: valid[-1]}
        yield tuple(valid), {params[-1][0]: valid[-1]}  # given twice
    yield tuple(valid), {"bogus": 0}


def constructor_vectors() -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Only vectors cupy refuses before ``ncclCommInitRank`` (a wrong type, a range, the commId's length): every one
    that converts carries a 10-byte commId, which ends in ``ValueError`` first."""
    for probe in PROBES:
        yield (probe, SHORT_ID, 0), {}
        yield (2, SHORT_ID, probe), {}
        if not (type(probe) is bytes and len(probe) == sim_nccl.UNIQUE_ID_BYTES):
            yield (2, probe, 0), {}
    for commId in (bytearray(128), "x" * 128, _Bytes(b"x" * 128), memoryview(b"x" * 128), b"", b"x" * 127,  # noqa: N806
                   b"x" * 129, [0] * 128):
        yield (2, commId, 0), {}
    yield (2, SHORT_ID, 0, None), {}
    yield (2, SHORT_ID, 0, 5), {}
    yield (2, SHORT_ID), {}
    yield (), {"ndev": 2, "commId": SHORT_ID, "rank": 0}
    yield (2, SHORT_ID, 0), {"config": None}
    yield (2, SHORT_ID, 0), {"bogus": 1}


def _safe_for_the_binding(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A constructor vector must never reach ``ncclCommInitRank`` (CUDA) on the binding."""
    commId = args[1] if len(args) > 1 else kwargs.get("commId")  # noqa: N806 - cupy's name
    assert not (type(commId) is bytes and len(commId) == sim_nccl.UNIQUE_ID_BYTES), (args, kwargs)


def conversion_differences(real: types.SimpleNamespace, methods: set[str]) -> list[str]:
    """Every vector through the binding and the sim: where the exception type (or NCCL status) differs."""
    problems = []
    theirs = real.nccl.NcclCommunicator.__new__(real.nccl.NcclCommunicator)  # cupy's NULL handle
    ours = sim_nccl.NcclCommunicator.__new__(sim_nccl.NcclCommunicator)
    for name in sorted(methods):
        for args, kwargs in method_vectors(getattr(real.nccl.NcclCommunicator, name)):
            want, got = outcome(getattr(theirs, name), args, kwargs), outcome(getattr(ours, name), args, kwargs)
            if want != got:
                problems.append(f"{name}(*{args!r}, **{kwargs!r}): cupy {want}, the sim {got}")
    for args, kwargs in constructor_vectors():
        _safe_for_the_binding(args, kwargs)
        want = outcome(real.nccl.NcclCommunicator, args, kwargs)
        got = outcome(sim_nccl.NcclCommunicator, args, kwargs)
        if want != got:
            problems.append(f"NcclCommunicator(*{args!r}, **{kwargs!r}): cupy {want}, the sim {got}")
    return problems


def _used_methods(real: types.SimpleNamespace) -> set[str]:
    methods = {n for n in dir(real.nccl.NcclCommunicator) if not n.startswith("_")}
    return (product_cupy_names(real) & methods) - {"comm"}


def test_the_sim_converts_every_argument_as_cupys_binding_does():
    """On this machine, no Sim installed (the sim's constructor refuses every vector before it needs one)."""
    real = _binding()
    used = _used_methods(real)
    assert {"reduce", "allReduce", "reduceScatter", "allGather", "send", "recv", "abort", "destroy",
            "check_async_error"} <= used
    assert conversion_differences(real, used) == []
    # what the vectors cover, on the binding itself: each kind of refusal, and values a C int truncates
    theirs = real.nccl.NcclCommunicator.__new__(real.nccl.NcclCommunicator)
    assert outcome(theirs.reduce, (1.5, 0, 1, 0, 0, 0, 0), {}) == ("TypeError", None)
    assert outcome(theirs.reduce, (0, 0, -1, 0, 0, 0, 0), {}) == ("OverflowError", None)
    assert outcome(theirs.reduce, (0, 0, 1, 0, 0, 2**31, 0), {}) == ("OverflowError", None)
    assert outcome(theirs.reduce, (0, 0, 1.5, 0, 0, 0, 0), {}) == ("NcclError", sim_nccl.INVALID_ARGUMENT)
    assert outcome(real.nccl.NcclCommunicator, (2, SHORT_ID, 0), {}) == ("ValueError", None)
    assert outcome(real.nccl.NcclCommunicator, (2, bytearray(128), 0), {}) == ("TypeError", None)


def test_negative_control_the_sims_coercing_constructor_and_unchecked_calls_are_caught(monkeypatch):
    """The sim before issue 46: ``int(ndev)``, ``bytes(commId)``, and a reduce that converted nothing."""
    real = _binding()

    def coercing_init(self, ndev, commId, rank):  # noqa: N803 - cupy's name
        self._nccl = sim_nccl._sim().nccl
        self._member = self._nccl.new_member(int(ndev), bytes(commId), int(rank))

    def unchecked_reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        m = self._m()
        self._nccl.call(m, "reduce", (sendbuf, count), (recvbuf, count) if m.rank == root else None, count,
                        datatype, op, root, stream)

    monkeypatch.setattr(sim_nccl.NcclCommunicator, "__init__", coercing_init)
    monkeypatch.setattr(sim_nccl.NcclCommunicator, "reduce", unchecked_reduce)
    problems = conversion_differences(real, {"reduce"})
    assert "reduce(*(1.5, 0, 1, 0, 0, 0, 0), **{}): cupy ('TypeError', None), the sim ('NcclError', 4)" in problems
    assert ("NcclCommunicator(*(2, bytearray(b'" in "\n".join(problems)
            and "cupy ('TypeError', None), the sim ('SimError', None)" in "\n".join(problems))


# ---- abort and destroy never raise -------------------------------------------------------------------------------


def test_abort_and_destroy_never_raise_and_the_sim_refuses_to_inject_a_failing_one():
    """cupy's ``abort()``/``destroy()`` call NCCL's ``void ncclCommAbort``/``ncclCommDestroy`` and ignore the status
    (``cupy_backends/cuda/libs/nccl.pyx``, 14.2: ``cdef extern ... void ncclCommAbort(ncclComm_t comm) nogil``). The
    sim's return even on a communicator with an asynchronous error and every call failing."""
    real = _binding()
    for handle in (real.nccl.NcclCommunicator.__new__(real.nccl.NcclCommunicator),
                   sim_nccl.NcclCommunicator.__new__(sim_nccl.NcclCommunicator)):
        assert handle.abort() is None and handle.destroy() is None  # the NULL handle: nothing to do
    with Sim() as sim:
        for kind in ("abort", "destroy"):
            with pytest.raises(ValueError, match=rf"cupy's {kind}\(\) never raises"):
                sim.nccl.inject(kind, sim_nccl.INTERNAL_ERROR)
        nccl = importlib.import_module("cupy.cuda.nccl")  # the sim's, while installed
        comms = [nccl.NcclCommunicator(1, nccl.get_unique_id(), 0) for _ in range(2)]
        sim.nccl.inject("*", sim_nccl.REMOTE_ERROR, once=False)
        for comm in comms:
            sim.nccl.async_error(comm.member, sim_nccl.REMOTE_ERROR)
        assert comms[0].abort() is None and comms[1].destroy() is None
        assert comms[0].abort() is None and comms[1].destroy() is None  # again: cupy holds NULL by then
        with pytest.raises(nccl.NcclError, match="INVALID_ARGUMENT"):
            comms[0].check_async_error()  # as NCCL's for the NULL handle cupy keeps after an abort
        assert sim.nccl.calls_of(0) == ["abort", "destroy"]


# ---- torch's __dlpack__ ----------------------------------------------------------------------------------------


def _dlpack_signature(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


DLPACK_VECTORS = (((-1,), {}), ((), {"stream": 1.5}), ((), {"stream": "1"}), ((), {"stream": True}),
                  ((), {"bogus": 1}), ((), {"dl_device": 1}), ((), {"dl_device": "cpu"}), ((), {"dl_device": (1,)}),
                  ((), {"dl_device": (2, 0, 0)}), ((), {"dl_device": (2.0, 0)}), ((), {"dl_device": (99, 0)}),
                  ((), {"copy": "yes"}), ((), {"max_version": 1}))


def test_sim_tensors_dlpack_has_torchs_signature_and_refuses_what_torch_refuses():
    """Torch's own checks that do not depend on the device, on a CPU tensor and a sim tensor alike."""
    assert _dlpack_signature(SimTensor.__dlpack__) == _dlpack_signature(torch.Tensor.__dlpack__)
    cpu = torch.ones(4)
    with Sim():
        device = torch.ones(4, device="cuda")
        for args, kwargs in DLPACK_VECTORS:
            assert outcome(device.__dlpack__, args, kwargs) == outcome(cpu.__dlpack__, args, kwargs), (args, kwargs)


def test_sim_tensors_dlpack_checks_the_device_and_orders_the_consumer_stream_as_torchs_cuda_path():
    """``torch/_tensor.py`` (2.13) for a CUDA tensor: the current device must be the tensor's; 2 and 0 are refused;
    None and 1 make the default stream wait for the current one, a stream handle that stream; -1 orders nothing;
    ``dl_device`` naming another device is refused without ``copy``. (A tensor on a second device is the point here:
    its context is not the product's, so contexts are not checked.)"""
    with Sim(strict_contexts=False) as sim:
        with torch.cuda.device(1):
            other = torch.ones(4, device="cuda")
        with pytest.raises(BufferError, match=r"different CUDA device index. Expected: 1. Current device: 0\."):
            other.__dlpack__(stream=-1)
        x = torch.zeros(64, device="cuda")
        with pytest.raises(BufferError, match="per-thread default stream is not supported"):
            x.__dlpack__(stream=2)
        with pytest.raises(AssertionError, match="unsupported stream on CUDA: 0"):
            x.__dlpack__(stream=0)
        with pytest.raises(SimError, match="no stream of the simulated device has this handle"):
            x.__dlpack__(stream=0x1234)
        with pytest.raises(ValueError, match=r"cannot move \(i.e. copy=False\) tensor from cuda:0 to cpu"):
            x.__dlpack__(dl_device=(1, 0), copy=False)
        assert x.__dlpack__(dl_device=(2, 0)).ptr == x.data_ptr()
        side = torch.cuda.Stream()
        waits = sim.counters["wait_event"]
        with torch.cuda.stream(side):
            x.__dlpack__(stream=-1)  # no synchronization
            assert sim.counters["wait_event"] == waits
            x.__dlpack__()  # the default: -1 too
            assert sim.counters["wait_event"] == waits
            x.__dlpack__(stream=1)  # the legacy default stream waits for the current (side) one
            assert sim.counters["wait_event"] == waits + 1
            assert torch.cuda.default_stream().tail.name.startswith("wait_event")
        x.__dlpack__(stream=side.cuda_stream)  # the side stream waits for the current (default) one
        assert sim.counters["wait_event"] == waits + 2 and side.tail.name.startswith("wait_event")
        copied = x.__dlpack__(copy=True)
        assert copied.ptr != x.data_ptr() and copied.nbytes == x.numel() * 4
        # the product's call (nccl_comm._view_of), and cupy's view of it
        capsule = x.detach().view(torch.uint8).__dlpack__(stream=-1)
        assert (capsule.ptr, capsule.nbytes, capsule.device, capsule.versioned) == (x.data_ptr(), 256, 0, False)
        assert x.__dlpack__(max_version=(1, 0)).versioned
