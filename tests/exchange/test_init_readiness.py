"""What init settles before any flush (issue 37, findings 4 and 5): under torch.distributed every node, rail and node
hand-off group runs one tiny collective at its creation, every rank of it together, within init's deadline (torch's
NCCL backend creates a group's communicator inside its first operation, and ``batch_isend_irecv`` as a group's first
operation is undefined unless every rank joins it); and ``NCCL_COMM_BLOCKING`` other than 1 is refused by every rank
together, naming the variable and each rank's value (cupy cannot represent ``ncclInProgress``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from owner_reduce import OwnerReduceCommError
from owner_reduce.planning.flags import OwnerReduceFlags
from owner_reduce.planning.rank_inputs import NCCL_BLOCKING_ENV_VAR, check_nccl_blocking, read_inputs
from owner_reduce.planning.settings import OwnerReduceSettings
from owner_reduce.runtime.deadline import Deadline
from owner_reduce.runtime.handle import OwnerReduceMismatchError
from owner_reduce.runtime.torch_comm import TorchDistComm
from tests.support.fakes import ExchangeWorld, flat_map, mirror_runtime
from tests.support.tdist import FakeTdist

ROOT = Path(__file__).resolve().parents[2]

# ---- finding 4: the torch groups are warmed at their creation ------------------------------------------------------


def test_every_new_group_is_warmed_by_one_collective_at_its_creation_before_any_flush():
    tdist = FakeTdist(ranks=range(4), backend="gloo")  # global rank 0 of 4, data-parallel over WORLD
    dp = TorchDistComm(tdist.world, tdist=tdist)
    node = dp.split([[0, 1], [2, 3]], "node")
    rail = dp.split([[0, 2], [1, 3]], "rail")
    handoff = dp.split([[0, 1], [2, 3]], "node hand-off")
    assert [g.ops for g in tdist.made] == [["all_reduce(count=1)"]] * 3  # at init: every group's first operation
    assert [g.ranks for g in tdist.made] == [[0, 1], [0, 2], [0, 1]]
    with handoff.group(flush=1):  # the first flush's hand-off round
        handoff.send(torch.ones(2), 1)
        handoff.recv(torch.zeros(2), 1)
    with rail.group(flush=1):
        rail.reduce(torch.ones(2), 1)
    assert tdist.made[2].ops == ["all_reduce(count=1)", "batch_isend_irecv(count=2)", "batch_isend_irecv(count=2)"]
    assert tdist.made[1].ops == ["all_reduce(count=1)", "reduce(count=2)"] and node is dp.subs[0]
    assert tdist.world.ops == []  # the data-parallel group itself is DeepSpeed's, used already


def test_a_warm_up_that_never_completes_fails_within_inits_deadline_naming_the_group():
    tdist = FakeTdist(ranks=range(4), backend="gloo", complete=False)
    dp = TorchDistComm(tdist.world, tdist=tdist)
    dp.deadline = Deadline(0.5, "test")
    with pytest.raises(OwnerReduceCommError) as caught:
        dp.split([[0, 2], [1, 3]], "rail")
    assert str(caught.value).startswith("owner_reduce: rank 0, outside a flush: warm-up all_reduce(count=1, "
                                        "dtype=float32) on the rail communicator timed out after waiting 0.5 s (the "
                                        "deadline, from test; measured ")  # the deadline it was made under: init's


_BLOCKED_WARM_UP = """
import threading
from owner_reduce.runtime import deadline
from owner_reduce.runtime.torch_comm import TorchDistComm
from tests.support.tdist import FakeTdist

class Tdist(FakeTdist):  # torch's NCCL backend creating the new group's communicator inside its first call
    def all_reduce(self, buf, op, group, async_op): threading.Event().wait()  # a peer never joins

comm = TorchDistComm(None, tdist=Tdist())
comm.set_deadline(deadline.resolve(1.5, None))  # compile.reduce_to_owner_timeout_s 1.5
comm.split([[0, 1]], "node")
print("returned", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_warm_up_blocked_in_its_call_ends_the_process_at_the_deadline():
    """The call itself cannot be interrupted (torch creates the NCCL communicator inside it, waiting for every rank):
    as a blocked ``ncclCommInitRank``, the process ends with status 1 at the deadline, saying which group."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _BLOCKED_WARM_UP], env=env, capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 1 and "returned" not in done.stdout, (done.stdout, done.stderr[-2000:])
    assert time.monotonic() - started < 45
    assert ("owner_reduce: rank 0: the warm-up all_reduce(count=1) of the new node group (torch creates its NCCL "
            "communicator there) has not returned after 1.5 s") in done.stderr


# ---- finding 5: NCCL_COMM_BLOCKING -----------------------------------------------------------------------------------

OWNER_PATH = OwnerReduceSettings(OwnerReduceFlags(reduce_to_owner=True))


def read_environment(env, reduce_to_owner=True):
    return read_inputs(OWNER_PATH if reduce_to_owner else OwnerReduceSettings(), env)


@pytest.mark.parametrize("value", [None, "", " 1 ", "1"])
def test_blocking_nccl_is_accepted(value):
    check_nccl_blocking(value)
    env = {} if value is None else {NCCL_BLOCKING_ENV_VAR: value}
    assert read_environment(env).problems == ()


def test_non_blocking_nccl_is_a_reason_naming_the_variable_and_its_value():
    ((variable, reason),) = read_environment({NCCL_BLOCKING_ENV_VAR: "0"}).problems
    assert variable == NCCL_BLOCKING_ENV_VAR
    assert reason == ("NCCL_COMM_BLOCKING='0': owner_reduce's NCCL calls through cupy need blocking communicators "
                      "(NCCL_COMM_BLOCKING unset or 1): in a non-blocking one every call may return ncclInProgress "
                      "(7), which cupy's NcclError cannot represent")
    assert read_environment({NCCL_BLOCKING_ENV_VAR: "0"}, reduce_to_owner=False).problems != ()  # every path


@pytest.mark.timeout(30)
def test_non_blocking_nccl_is_refused_at_init_by_every_rank_together_naming_each_ranks_value():
    envs = [{NCCL_BLOCKING_ENV_VAR: "0"}, {}, {NCCL_BLOCKING_ENV_VAR: "1"}, {NCCL_BLOCKING_ENV_VAR: "false"}]
    world = ExchangeWorld(len(envs), timeout_s=10.0)
    owner_map = flat_map([40] * 6, len(envs))
    with pytest.raises(OwnerReduceMismatchError) as caught:
        world.run(lambda rank: mirror_runtime(owner_map, rank=rank, comm=world.comm(rank),
                                              env_problems=read_environment(envs[rank]).problems))
    message = str(caught.value)
    assert "refusing to start: rank 0: NCCL_COMM_BLOCKING='0': owner_reduce's NCCL calls through cupy" in message
    assert "; rank 3: NCCL_COMM_BLOCKING='false': owner_reduce's NCCL calls through cupy" in message
    assert "rank 1:" not in message and "rank 2:" not in message
    notes = getattr(caught.value, "__notes__", [])
    assert sum(": OwnerReduceMismatchError: " in n for n in notes) == len(envs) - 1, notes  # no rank left waiting
