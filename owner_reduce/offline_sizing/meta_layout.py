"""DeepSpeed's ZeRO-1 partition tables for a model that is never given storage: meta tensors through
DeepSpeed's own partition methods.

Why: the real-engine builder (``fake_engine.build_engine_layout``) copies every parameter into a flat bf16
buffer and keeps an fp32 partition with Adam state, so a 1 B model costs 3.4 GB and a 7 B one cannot be sized
on a CPU box. The owner map needs shapes only. Here the model is built on the meta device, and the methods of
``DeepSpeedZeroOptimizer`` (deepspeed 0.19.x, runtime/zero/stage_1_and_2.py) that compute the layout run on
an instance made with ``object.__new__`` and given only the attributes they read:

- called from DeepSpeed: ``deepspeed.runtime.utils.is_optimized_parameter`` (which parameters a group keeps),
  ``_round_robin_reorder`` (when the config asks for it), ``flatten_dense_tensors_aligned`` (which calls
  ``runtime.utils.align_dense_tensors`` and torch's ``_flatten_dense_tensors``, on meta tensors),
  ``get_data_parallel_partitions``, ``get_partition_info`` and
  ``initialize_gradient_partitioning_data_structures`` (which fills ``param_to_partition_ids``,
  ``grad_start_offset`` and ``grad_partition_insertion_offset`` through ``initialize_gradient_partition`` and
  ``get_first_param_index``), ``get_param_id``; ``deepspeed.comm`` answers the world size and rank of the
  data-parallel group (``utils.groups._get_sequence_data_parallel_group``, as the engine passes it) in the
  fake process group; ``runtime.zero.config.get_zero_config`` reads the config's bucket size, round-robin and
  parameter-alignment settings with DeepSpeed's defaults.
- mirrored, because they are inline statements of ``DeepSpeedZeroOptimizer.__init__`` or of
  ``DeepSpeedEngine._configure_optimizer`` that no method exposes: dropping empty optimizer groups, the group
  alignment ``nccl_start_alignment_factor (2) * dp world size``, the per-parameter padding loop
  (``parameter_alignment``), ``partition_size = len(flat) // world size`` and the param-id numbering (group by
  group, in group order). ``MIRRORED_SOURCE`` lists those statements; ``check_mirrored_source`` refuses to
  build when DeepSpeed's source no longer contains one of them, and the result is checked against
  ``get_data_parallel_partitions`` (every partition ``partition_size`` long) and, through
  ``wiring.engine_tables.disagreements_with_optimizer``, against ``get_partition_info``'s view of rank 0.
- not supported: MoE layers (expert groups partition over other communicators, set up by
  ``_configure_moe_settings`` from live groups): the builder refuses them; use the real-engine builder.

``tests/processes/test_sizing_at_scale.py`` checks that ``OwnerMap.digest()``, the gradient order and the bucket size
equal the real engine's for GPT and Llama presets at several world sizes, with one and two parameter groups.
"""

from __future__ import annotations

import inspect
import math
import re
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from .fake_world import BuiltLayout, grad_order_of, init_fake_world, zero1_sizing_config
from .model_spec import ModelSpec, build_meta_model

NCCL_START_ALIGNMENT_FACTOR = 2  # DeepSpeedZeroOptimizer.__init__: "4-byte alignment/sizeof(fp16) = 2"

# Statements this module mirrors, as DeepSpeed 0.19.x writes them (whitespace-insensitive), by where they live.
MIRRORED_SOURCE: dict[str, tuple[str, ...]] = {
    "DeepSpeedZeroOptimizer.__init__": (
        "self.flatten = _flatten_dense_tensors if not self.zenflow else zenflow_utils._flatten_dense_tensors",
        "self.nccl_start_alignment_factor = 2",
        "if is_optimized_parameter(param):",
        "alignment = self.nccl_start_alignment_factor * dist.get_world_size(group=self.real_dp_process_group[i])",
        "param_alignment = 16 // math.gcd(16, element_size) if self.parameter_alignment else 1",
        "padding = 0 if param_index == len(meta_tensors) - 1 else (-current_offset) % param_alignment",
        "param_padding=param_padding).detach()",
        "partition_size = len(self.bit16_groups_flat[i]) // dist.get_world_size(group=self.real_dp_process_group[i])",
        "self.param_id[unique_id] = count",
        "self.initialize_gradient_partitioning_data_structures()",
    ),
    "DeepSpeedEngine._configure_optimizer": (
        'basic_optimizer.param_groups[:] = [pg for pg in basic_optimizer.param_groups if len(pg["params"]) != 0]',
    ),
}


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def check_mirrored_source(sources: dict[str, str] | None = None) -> list[str]:
    """The mirrored statements that DeepSpeed's source (or ``sources``, by ``MIRRORED_SOURCE`` key) lacks."""
    if sources is None:
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        sources = {"DeepSpeedZeroOptimizer.__init__": inspect.getsource(DeepSpeedZeroOptimizer.__init__),
                   "DeepSpeedEngine._configure_optimizer": inspect.getsource(DeepSpeedEngine._configure_optimizer)}
    missing = []
    for where, statements in MIRRORED_SOURCE.items():
        body = _squash(sources.get(where, ""))
        missing += [f"{where}: {s}" for s in statements if _squash(s) not in body]
    return missing


def _meta_stand_in(param: torch.Tensor) -> torch.Tensor:
    """The parameter itself when it is on the meta device, else a meta tensor of its shape and dtype."""
    if param.is_meta:
        return param
    stand_in = torch.empty(param.shape, dtype=param.dtype, device="meta")
    stand_in.requires_grad_(param.requires_grad)
    return stand_in


def _refuse_moe(model: nn.Module) -> None:
    from deepspeed.moe.layer import MoE

    if any(isinstance(m, MoE) for m in model.modules()):
        raise NotImplementedError("the meta layout builder does not size MoE layers (expert groups partition "
                                  "over their own communicators); use the real engine (exact_engine=True)")


def zero_partitioning(groups: Sequence[Sequence[torch.Tensor]], config: dict[str, Any]) -> Any:
    """A ``DeepSpeedZeroOptimizer`` carrying only the partition tables of ``groups`` (meta tensors) as rank
    ``dist.get_rank()`` of the fake world; built without running ``__init__`` (see the module docstring)."""
    import deepspeed.comm as dist
    from deepspeed.runtime.utils import is_optimized_parameter
    from deepspeed.runtime.zero.config import get_zero_config
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils import groups as ds_groups
    from torch._utils import _flatten_dense_tensors

    missing = check_mirrored_source()
    if missing:
        raise RuntimeError("DeepSpeed's ZeRO-1 source changed where the meta layout builder mirrors it ("
                           + "; ".join(missing) + "); size with the real engine (--exact-engine)")
    zero_config = get_zero_config(config)
    dp_group = ds_groups._get_sequence_data_parallel_group()  # what the engine passes as dp_process_group
    zero: Any = object.__new__(DeepSpeedZeroOptimizer)
    zero.flatten = _flatten_dense_tensors
    zero.nccl_start_alignment_factor = NCCL_START_ALIGNMENT_FACTOR
    zero.parameter_alignment = zero_config.parameter_alignment
    zero.round_robin_gradients = zero_config.round_robin_gradients
    zero.real_dp_process_group = [dp_group for _ in groups]
    zero.partition_count = [dist.get_world_size(group=dp_group) for _ in groups]
    for name in ("bit16_groups", "bit16_groups_flat", "parallel_partitioned_bit16_groups", "round_robin_bit16_groups",
                 "round_robin_bit16_indices", "round_robin_bit16_padding", "round_robin_bit16_offsets",
                 "partition_size", "params_in_partition", "params_not_in_partition", "first_offset"):
        setattr(zero, name, [])
    for i, params in enumerate(groups):
        partition_id = dist.get_rank(group=zero.real_dp_process_group[i])
        world = dist.get_world_size(group=zero.real_dp_process_group[i])
        trainable = [p for p in params if is_optimized_parameter(p)]
        if not trainable:
            raise ValueError(f"optimizer group {i} has no trainable parameter with elements; "
                             "DeepSpeed's ZeRO-1 fails on such a group too")
        zero.bit16_groups.append(trainable)
        alignment = zero.nccl_start_alignment_factor * world
        element_size = torch.tensor([], dtype=trainable[0].dtype).element_size()
        param_alignment = 16 // math.gcd(16, element_size) if zero.parameter_alignment else 1
        if zero.round_robin_gradients:
            tensors, indices = zero._round_robin_reorder(trainable, world)
        else:
            tensors, indices = trainable, list(range(len(trainable)))
        zero.round_robin_bit16_groups.append(tensors)
        zero.round_robin_bit16_indices.append(indices)
        padding, offsets, current = [], [], 0
        for index, tensor in enumerate(tensors):
            offsets.append(current)
            current += tensor.numel()
            padding.append(0 if index == len(tensors) - 1 else (-current) % param_alignment)
            current += padding[-1]
        zero.round_robin_bit16_padding.append(padding)
        zero.round_robin_bit16_offsets.append(offsets)
        flat = zero.flatten_dense_tensors_aligned(tensors, alignment, use_cpu_data=False, param_padding=padding)
        zero.bit16_groups_flat.append(flat)
        partitions = zero.get_data_parallel_partitions(flat, i)
        zero.parallel_partitioned_bit16_groups.append(partitions)
        partition_size = len(flat) // world
        if {p.numel() for p in partitions} != {partition_size}:
            raise RuntimeError(f"group {i}: DeepSpeed's partitions hold {sorted({p.numel() for p in partitions})} "
                               f"elements, the mirrored partition_size is {partition_size}")
        inside, outside, first_offset = zero.get_partition_info(tensors, partition_size, partition_id, padding)
        zero.partition_size.append(partition_size)
        zero.params_in_partition.append(inside)
        zero.params_not_in_partition.append(outside)
        zero.first_offset.append(first_offset)
    zero.param_id, zero.param_dict = {}, {}
    for params in zero.bit16_groups:
        for param in params:
            zero.param_dict[len(zero.param_id)] = param
            zero.param_id[id(param)] = len(zero.param_id)
    zero.is_param_in_current_partition = {zero.get_param_id(p): True for g in zero.params_in_partition for p in g}
    zero.is_param_in_current_partition.update(
        {zero.get_param_id(p): False for g in zero.params_not_in_partition for p in g})
    for name in ("param_to_partition_ids", "is_partition_reduced", "remaining_grads_in_partition",
                 "total_grads_in_partition", "is_grad_computed", "grad_partition_insertion_offset",
                 "grad_start_offset", "first_param_index_in_partition"):
        setattr(zero, name, {})
    zero.initialize_gradient_partitioning_data_structures()
    return zero


def build_meta_layout(spec: ModelSpec, world_size: int) -> BuiltLayout:
    """The layout of ``spec`` at ``world_size`` (this process becomes rank 0 of a fake world of that size)."""
    from deepspeed.runtime.zero.config import get_zero_config
    from deepspeed.utils import groups as ds_groups

    from ..planning.owner_map import OwnerMap
    from ..wiring.engine_tables import disagreements_with_optimizer, group_tables

    start = time.perf_counter()
    init_fake_world(world_size)
    model, notes = build_meta_model(spec)
    _refuse_moe(model)
    optimizer = torch.optim.Adam(spec.optimizer_groups(model), lr=1e-4)  # torch's own grouping and checks
    stand_ins = {id(p): _meta_stand_in(p) for p in model.parameters()}
    config = zero1_sizing_config()
    groups = [[stand_ins[id(p)] for p in group["params"]] for group in optimizer.param_groups if group["params"]]
    zero = zero_partitioning(groups, config)
    engine = SimpleNamespace(optimizer=zero, data_parallel_group=ds_groups._get_data_parallel_group())
    owner_map = OwnerMap.from_group_tables(
        group_tables(engine), dp_world_size=world_size,
        tensor_ids={id(p): zero.param_id[id(s)] for p in model.parameters()
                    if id(s := stand_ins[id(p)]) in zero.param_id})
    problems = disagreements_with_optimizer(owner_map, engine)
    if problems:
        raise RuntimeError("meta layout contradicts DeepSpeed's own partition info: " + "; ".join(problems[:5]))

    def param_id(p: nn.Parameter) -> int | None:
        return zero.param_id.get(id(stand_ins[id(p)]))

    notes.insert(0, f"meta layout builder: DeepSpeedZeroOptimizer's partition methods on meta tensors, "
                    f"no parameter storage, rank 0 of {world_size}")
    return BuiltLayout(owner_map=owner_map, grad_order=grad_order_of(model, param_id),
                       reduce_bucket_size=int(get_zero_config(config).reduce_bucket_size),
                       optimizer_class=type(zero).__name__, seconds=time.perf_counter() - start, notes=tuple(notes))
