"""One rank's training run for the CPU demo, the benchmark and the end-to-end tests.

Why one function for all three: "plain ZeRO-1" and "DeepCompile + owner_reduce" must see exactly the same
model, data and optimizer, and the only way to be sure of that is to build both in one place. Runs inside
a rank started by ``harness.launch.run_ranks``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# ZeRO eager hooks / ZeRO + torch.compile / DeepCompile + owner_reduce / DeepCompile's native runtime (GPU only)
MODES = ("plain", "compiled", "owner", "native")


@dataclass(frozen=True)
class TrainSpec:
    mode: str = "owner"
    backend: str = "eager"  # torch.compile / DeepCompile backend for "compiled" and "owner"
    steps: int = 5
    grad_accum: int = 1
    same_data: bool = True  # identical batches on every rank (bitwise comparisons) or one stream per rank
    reduce_to_owner: bool = True
    reduce_probe: bool = True
    # Every rank's probe lines, as the tests read them (compile.reduce_probe_all_ranks; a user's default is rank 0's)
    probe_all_ranks: bool = True
    reduce_bucket_size: int | None = None
    model: str = "odd_mlp"  # or "tiny_transformer", "few_big_tensors", "tied_lm", "exact_linear"
    model_kwargs: tuple[tuple[str, Any], ...] = ()  # (name, value) pairs: specs stay hashable
    micro_batch: int = 4
    zero_stage: int = 1
    param_groups: int = 1  # 2: matrices in one optimizer group, vectors in another (two ZeRO partitionings)
    bf16: bool = False
    lr: float = 1e-2
    seed: int = 0
    record_collectives: bool = False
    progress: bool = False  # rank 0 draws a progress bar on stderr
    inject_fault: str | None = None  # negative controls only: see harness.faults
    time_runtime: bool = False  # host time of each reduce_grad (without flushes) and each flush, in ns
    flush_algo: str | None = None  # compile.reduce_to_owner_algo for this run (None: the key is left out: auto)
    # "SGD" for negative controls: Adam's update is nearly invariant to a gradient scaled by a constant, which is
    # what an element that missed its reduction holds with identical data on every rank (its own share).
    optimizer: str = "Adam"
    # DeepCompile's compile schedule: the steps at which its reduce pass is launched (each launch after the first
    # recompiles every graph: torch._dynamo.reset() and the handle's reset()); () is DeepCompile's default (step 0).
    compile_steps: tuple[int, ...] = ()
    checkpoint_dir: str | None = None  # where save_at saves and resume loads (engine.save/load_checkpoint)
    # save a checkpoint after this many optimizer steps (the run goes on to ``steps``); a tuple: after each (tags
    # ``global_stepN``, DeepSpeed's default)
    save_at: int | tuple[int, ...] | None = None
    load_tag: str | None = None  # resume: the checkpoint's tag (None: DeepSpeed's ``latest``)
    # Load checkpoint_dir after engine.compile() and before the first forward, as a user resuming does, then train
    # from the checkpoint's step to ``steps`` on the batches an uninterrupted run would see; losses start there.
    resume: bool = False
    load_before_compile: bool = False  # resume: load before engine.compile() instead of after it
    reuse_graph_ids: bool = False  # rank 0 reuses its graph ids after a recompile, other ranks never (graph_ids.py)
    # deepspeed.utils.safe_get_full_grad of every parameter between the boundary backward and its step
    full_grads: bool = False
    # Ranks grouped as nodes of this many (LOCAL_WORLD_SIZE, and LOCAL_RANK = rank % it, as torchrun sets them on
    # several nodes): the two-level flush's node and rail communicators; 0 keeps the launch's (one node).
    ranks_per_node: int = 0
    env: tuple[tuple[str, str], ...] = ()  # environment variables for this run only (e.g. NCCL_DEBUG)
    # More keys of the compile section (planning.settings), e.g. (("reduce_to_owner_verdicts", path),)
    compile_keys: tuple[tuple[str, Any], ...] = ()
    log_level: str | None = None  # the DeepSpeed config's log_level ("info": owner_reduce's lines are shown)
    # Return every line DeepSpeed's logger emitted at INFO or above from compile on (owner_reduce's are INFO)
    capture_log: bool = False
    destroy: bool = False  # engine.destroy() at the end: another owner engine may follow in the same launch
    # A DeepSpeed config file (JSON) in place of ``ds_config(spec)``: DeepSpeed reads it, as a user's job does (it must
    # match the spec's model, batch and optimizer: write ``ds_config(spec)`` and edit what the run is about)
    config_file: str | None = None
    # The two-level flush's rail steps the model may choose (``planning.two_level.RAIL_STEPS``; () all of them): tests
    # cover each one where the model would pick another at their sizes.
    rail_steps: tuple[str, ...] = ()
    rail_layouts: tuple[str, ...] = ()  # the two-level layouts the model may choose (``two_level.RAIL_LAYOUTS``)
    # The padding a two-level flush may add, as a share of the flush (``owner_layout.TWO_LEVEL_MAX_PADDING_SHARE``;
    # None: the product's): a toy flush of a hundred elements pads its blocks to 16-byte slices past an eighth.
    two_level_max_padding_share: float | None = None
    # DeepSpeed's ``gradient_clipping``: None leaves the key out, so DeepSpeed's default applies (1.0: clipping on);
    # 0 is off (a negative control's bound assumes an unclipped step)
    gradient_clipping: float | None = None
    check_grad_overflow: bool = False  # bf16's ``check_grad_overflow``: a step with inf or nan gradients is skipped
    inf_at: tuple[int, int] | None = None  # (step, rank), 1-based step: that rank's first micro-step loss times inf
    # resume with load_before_compile: ``engine.compile(schedule=[(global_steps, [reduce pass])])``, the compile
    # schedule a user starts at the loaded step
    compile_at_loaded_step: bool = False
    # The measured guard's samples from ``fixed_samples.FixedSamples`` instead of the streams' clock: this rank's
    # ((flush, variant, round), us) pairs are ``trial_samples[rank]`` (() keeps the streams' clock)
    trial_samples: tuple[tuple[tuple[tuple[int, int, int], float], ...], ...] = ()
    # The steps under ``torch.profiler.profile`` (CPU activity), its trace exported as Chrome JSON to this path
    # (``{rank}`` is this rank's number): what a user's profiler shows of the flushes (``runtime.flush`` Note
    # (profiler ranges))
    profile_trace: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"TrainSpec.mode must be one of {MODES}, got {self.mode!r}")
        if (self.save_at is not None or self.resume) and self.checkpoint_dir is None:
            raise ValueError("TrainSpec.save_at and TrainSpec.resume need TrainSpec.checkpoint_dir")


def train_each(rank: int, world_size: int, specs: tuple[TrainSpec, ...]) -> list[dict]:
    """Several runs, one after the other, in these ranks (``run_ranks``' function); each starts from the environment
    the launch gave (a run's ``env`` or ``ranks_per_node`` sets variables for itself only)."""
    environ = dict(os.environ)
    results = []
    for spec in specs:
        results.append(train(rank, world_size, spec))
        os.environ.clear()
        os.environ.update(environ)
    return results


def _compile_schedule(spec: TrainSpec) -> list | None:
    """``spec.compile_steps`` as DeepCompile's schedule: its own stage-1/2 reduce pass at each step, as a user writes
    it (owner_reduce swaps in its own pass when a flag is on)."""
    if not spec.compile_steps or spec.mode not in ("owner", "native"):
        return None
    from deepspeed.compile.passes import zero_1_and_2_compile

    reduce_pass = zero_1_and_2_compile.add_z2_reduce if spec.zero_stage == 2 else zero_1_and_2_compile.add_z1_reduce
    return [(step, [reduce_pass]) for step in spec.compile_steps]


def ds_config(spec: TrainSpec) -> dict[str, Any]:
    """The DeepSpeed config ``train`` runs ``spec`` with (what a test writes to a file for ``config_file``)."""
    zero: dict[str, Any] = {"stage": spec.zero_stage}
    if spec.reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = spec.reduce_bucket_size
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": spec.grad_accum,
        "optimizer": {"type": "Adam", "params": {"lr": spec.lr, "torch_adam": True}} if spec.optimizer == "Adam"
        else {"type": spec.optimizer, "params": {"lr": spec.lr}},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
    }
    if spec.optimizer != "Adam":
        config["zero_allow_untested_optimizer"] = True  # a torch.optim class by name: ZeRO partitions it as any
    if spec.bf16:
        config["bf16"] = {"enabled": True, **({"check_grad_overflow": True} if spec.check_grad_overflow else {})}
    if spec.gradient_clipping is not None:
        config["gradient_clipping"] = spec.gradient_clipping
    if spec.log_level is not None:
        config["log_level"] = spec.log_level
    if spec.mode == "owner":
        config["compile"] = {"deepcompile": True, "reduce_to_owner": spec.reduce_to_owner,
                             "reduce_probe": spec.reduce_probe}
        if spec.reduce_probe and spec.probe_all_ranks:
            config["compile"]["reduce_probe_all_ranks"] = True
        if spec.flush_algo is not None:
            config["compile"]["reduce_to_owner_algo"] = spec.flush_algo
        config["compile"].update(spec.compile_keys)  # last: what a run names explicitly
    elif spec.mode == "native":
        config["compile"] = {"deepcompile": True}
    return config


def _model_and_batches(spec: TrainSpec, rank: int) -> tuple[Any, Any]:
    import torch

    from .toy_models import ExactLinear, FewBigTensors, OddMLP, TiedLM, TinyTransformer

    torch.manual_seed(spec.seed)
    generator = torch.Generator().manual_seed(1234 + (0 if spec.same_data else 7919 * (rank + 1)))
    if spec.model == "odd_mlp":
        model = OddMLP(**dict(spec.model_kwargs))
        d_in, d_out = model.fc1.in_features, model.fc3.out_features

        def batch() -> tuple[Any, Any]:
            return (torch.randn(spec.micro_batch, d_in, generator=generator),
                    torch.randn(spec.micro_batch, d_out, generator=generator))
    elif spec.model in ("tiny_transformer", "tied_lm"):
        if spec.model == "tiny_transformer":
            model = TinyTransformer(**dict(spec.model_kwargs))
            vocab = model.head.out_features
        else:
            model = TiedLM(**dict(spec.model_kwargs))
            vocab = model.embed.num_embeddings
        seq = model.pos.shape[0]

        def batch() -> tuple[Any, Any]:
            tokens = torch.randint(0, vocab, (spec.micro_batch, seq + 1), generator=generator)
            return tokens[:, :-1], tokens[:, 1:]
    elif spec.model == "exact_linear":
        model = ExactLinear(**dict(spec.model_kwargs))
        d_in, d_out = model.layers[0].in_features, model.d_out

        def batch() -> tuple[Any, Any]:
            return ExactLinear.batch(spec.micro_batch, d_in, d_out, generator)
    elif spec.model == "few_big_tensors":
        model = FewBigTensors(**dict(spec.model_kwargs))
        dim = model.weights[0].shape[0]

        def batch() -> tuple[Any, Any]:
            return (torch.randn(spec.micro_batch, dim, generator=generator),
                    torch.randn(spec.micro_batch, dim, generator=generator))
    else:
        raise ValueError(f"TrainSpec.model must be 'odd_mlp', 'tiny_transformer', 'few_big_tensors', 'tied_lm' or "
                         f"'exact_linear', got {spec.model!r}")
    return model, batch


def progress_line(done: int, total: int, loss: float) -> str | None:
    """Rank 0's progress bar after step ``done`` of ``total``: one whole line at the first step, at every tenth of
    the run and at the last step; None between them.

    Note (other writers): every rank prints its probe lines (and rank 0 its schedule and measured lines) to the same
    terminal or pipe, from processes of their own. A bar redrawn in place (``\\r``, no newline) leaves its line open
    between updates, so those lines were written into the middle of it. Each update is a line of its own, written
    in one write with its newline (as ``runtime.stats.emit`` writes the probe's), so no other line can fall inside
    it and nothing later overwrites it; at most 11 lines per run.
    """
    if done not in (1, total) and done * 10 // total == (done - 1) * 10 // total:
        return None
    width = 30
    filled = width * done // total
    return f"  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} steps  loss {loss:.4f}\n"


def _progress(done: int, total: int, loss: float) -> None:
    line = progress_line(done, total, loss)
    if line is not None:
        sys.stderr.flush()
        sys.stderr.write(line)
        sys.stderr.flush()


def _time_runtime(runtime: Any) -> dict[str, list[int]]:
    """Wrap the runtime's hot methods with host timers (instance attributes shadow the methods)."""
    timings: dict[str, list[int]] = {"reduce_grad_ns": [], "flush_ns": []}
    flusher = runtime.flusher
    reduce_grad, flush = runtime.reduce_grad, flusher.flush
    in_flush = [0]

    def timed_flush(pending: Any, streams: Any) -> None:
        start = time.perf_counter_ns()
        flush(pending, streams)
        elapsed = time.perf_counter_ns() - start
        timings["flush_ns"].append(elapsed)
        in_flush[0] += elapsed

    def timed_reduce_grad(grad: Any, graph_id: int, ds_id: int) -> None:
        in_flush[0] = 0
        start = time.perf_counter_ns()
        reduce_grad(grad, graph_id, ds_id)
        timings["reduce_grad_ns"].append(time.perf_counter_ns() - start - in_flush[0])

    flusher.flush = timed_flush
    runtime.reduce_grad = timed_reduce_grad
    return timings


def _first_flush_phases(runtime: Any, on_phase: Callable[[str], None]) -> None:
    """Report the runtime's first flush as two phases: issuing it, and the rest of that backward after it."""
    flusher = runtime.flusher
    flush = flusher.flush
    seen = [False]

    def flush_with_phases(pending: Any, streams: Any) -> None:
        if seen[0]:
            flush(pending, streams)
            return
        seen[0] = True
        on_phase("first flush: issuing its collectives (ncclGroupEnd may connect NCCL's transports)")
        flush(pending, streams)
        on_phase("after the first flush (rest of backward 1: end_backward waits for the reduce stream)")

    flusher.flush = flush_with_phases


class _CapturedLog:
    """Every record DeepSpeed's logger emits at INFO or above while attached, as its message (what the user sees,
    without the logger's time and place prefix). Only what the logger's own level lets through is recorded: the
    handler sees what the user's terminal would."""

    def __init__(self) -> None:
        import logging

        from deepspeed.utils import logger

        self.lines: list[str] = []
        self._logger = logger
        self._handler = logging.Handler(level=logging.INFO)
        self._handler.emit = lambda record: self.lines.append(record.getMessage())  # type: ignore[method-assign]
        logger.addHandler(self._handler)

    def close(self) -> list[str]:
        self._logger.removeHandler(self._handler)
        return self.lines


def _capture_log() -> _CapturedLog:
    return _CapturedLog()


def _group_as_nodes(rank: int, ranks_per_node: int) -> None:
    """Make this rank look like local rank ``rank % ranks_per_node`` of a node of ``ranks_per_node`` on a host of its
    node's own (what torchrun sets on several hosts). The runtime counts the ranks per node from the host names
    (``planning.nodes``): its reading of this host's name is replaced, for this process, by ``<host>-node<N>``. The
    local rank on the CPU through ``LOCAL_RANK`` itself. Where ranks share a GPU (the launchers here give every rank
    one visible device, ``LOCAL_RANK`` 0, the device DeepSpeed binds), ``LOCAL_RANK`` must stay: only the runtime's
    reading of it is replaced."""
    import socket

    import torch

    from owner_reduce.runtime import agreement

    local = rank % ranks_per_node
    host = f"{socket.gethostname()}-node{rank // ranks_per_node}"
    agreement.host_name = lambda: host
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    if torch.cuda.is_available():
        agreement.local_rank = lambda environ=None: local
    else:
        os.environ["LOCAL_RANK"] = str(local)


def train(rank: int, world_size: int, spec: TrainSpec,
          on_phase: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train ``spec.steps`` optimizer steps; return losses, final parameters, runtime counters and log lines.

    ``on_phase(name)`` (optional) is called as each phase starts: engine, compile, step 1's forward (DeepCompile
    compiles and profiles the forward graph there), backward and first flush, optimizer, each later step, the
    final barrier; a run that overstays its bound then says where it stopped (``harness.phases``).
    """
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    import owner_reduce

    phase = on_phase or (lambda name: None)

    if spec.inject_fault is not None:
        from .faults import inject

        inject(spec.inject_fault, world_size)
    if spec.reuse_graph_ids:
        from .graph_ids import reuse_graph_ids

        reuse_graph_ids(rank)
    os.environ.update(dict(spec.env))
    if spec.ranks_per_node:
        _group_as_nodes(rank, spec.ranks_per_node)
    if spec.rail_steps or spec.rail_layouts:
        from owner_reduce.planning import two_level

        two_level.RAIL_STEPS = spec.rail_steps or two_level.RAIL_STEPS
        two_level.RAIL_LAYOUTS = spec.rail_layouts or two_level.RAIL_LAYOUTS
    if spec.two_level_max_padding_share is not None:
        from owner_reduce.planning import owner_layout

        owner_layout.TWO_LEVEL_MAX_PADDING_SHARE = spec.two_level_max_padding_share
    model, batch = _model_and_batches(spec, rank)
    if spec.mode == "owner":
        owner_reduce.install()
    config: Any = spec.config_file or ds_config(spec)
    parameters: Any = model.parameters()
    if spec.param_groups == 2:
        params = list(model.parameters())
        parameters = [{"params": [p for p in params if p.dim() > 1]}, {"params": [p for p in params if p.dim() <= 1]}]
    phase("engine: deepspeed.initialize")
    captured = _capture_log() if spec.capture_log else None
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameters, config=config)
    accelerator = get_accelerator()
    compile_start = time.perf_counter()
    first_step = 0

    def load() -> int:
        phase(f"engine.load_checkpoint({spec.checkpoint_dir})")
        path, _ = engine.load_checkpoint(spec.checkpoint_dir, tag=spec.load_tag)
        if path is None:
            raise RuntimeError(f"no checkpoint found in {spec.checkpoint_dir}")
        for _ in range(engine.global_steps * spec.grad_accum):  # the batches the checkpointed run already trained on
            batch()
        return engine.global_steps

    if spec.resume and spec.load_before_compile:
        first_step = load()
    if spec.mode != "plain":
        phase("engine.compile (DeepCompile init: the owner runtime builds its communicator)")
        schedule = _compile_schedule(spec)
        if spec.compile_at_loaded_step:
            schedule = _compile_schedule(dataclasses.replace(spec, compile_steps=(first_step,)))
        engine.compile(backend=spec.backend, schedule=schedule)
    if spec.resume and not spec.load_before_compile:
        first_step = load()
    runtime = None
    timings: dict[str, list[int]] = {}
    losses: list[float] = []
    full_grads: list[dict[str, Any]] = []
    step_times: list[float] = []
    grad_norms: list[float | None] = []
    profiler = None
    if spec.profile_trace is not None:
        import torch

        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
    for step in range(first_step, spec.steps):
        start = time.perf_counter()
        for micro in range(spec.grad_accum):
            first = step == first_step and micro == 0
            phase(f"step {step + 1} forward (DeepCompile compiles and profiles the forward graph)" if first and
                  spec.mode != "plain" else f"step {step + 1} forward")
            loss = engine(*(t.to(engine.device) for t in batch()))
            if runtime is None and spec.mode == "owner":
                from owner_reduce.wiring.ops import active_runtime

                runtime = active_runtime()
                runtime.record_collectives = spec.record_collectives
                if spec.time_runtime:
                    timings = _time_runtime(runtime)
                if on_phase is not None:
                    _first_flush_phases(runtime, on_phase)
                if spec.trial_samples:
                    from .fixed_samples import FixedSamples

                    runtime.trial_clock = FixedSamples(dict(spec.trial_samples[rank]))
            if spec.inf_at == (step + 1, rank) and micro == 0:
                loss = loss * float("inf")  # every gradient inf or nan: the step overflows on every rank
            phase(f"step {step + 1} backward (DeepCompile compiles and profiles the backward graph, then reduces)"
                  if first and spec.mode != "plain" else f"step {step + 1} backward")
            engine.backward(loss)
            if spec.full_grads and micro == spec.grad_accum - 1:  # the boundary: the step that follows updates
                from deepspeed.utils import safe_get_full_grad

                phase(f"step {step + 1} safe_get_full_grad")
                full_grads.append({n: safe_get_full_grad(p).detach().cpu().clone()
                                   for n, p in engine.module.named_parameters()})
            phase(f"step {step + 1} optimizer")
            engine.step()
            losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        grad_norms.append(None if norm is None else float(norm))
        accelerator.synchronize()
        step_times.append(time.perf_counter() - start)
        if spec.progress and rank == 0:
            _progress(step + 1, spec.steps, losses[-1])
        if step == first_step:
            first_step_s = time.perf_counter() - compile_start
        if step + 1 in ((spec.save_at,) if isinstance(spec.save_at, int) else spec.save_at or ()):
            phase(f"engine.save_checkpoint({spec.checkpoint_dir}) after step {step + 1}")
            engine.save_checkpoint(spec.checkpoint_dir)
    if profiler is not None:
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(spec.profile_trace.format(rank=rank))
    phase("final barrier")
    dist.barrier()
    if spec.destroy:
        phase("engine.destroy()")
        engine.destroy()
    phase("done")
    return {
        "losses": losses,
        "params": {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()},
        # ZeRO's fp32 master partition of this rank (bf16/fp16 runs): where the owner's reduced gradient lands first
        "fp32_partitions": [t.detach().cpu().clone() for t in
                            getattr(engine.optimizer, "single_partition_of_fp32_groups", None) or ()],
        "comm": None if runtime is None or runtime.comm is None else type(runtime.comm).__name__,
        "stats": None if runtime is None else runtime.stats,
        "collective_log": None if runtime is None else list(runtime.collective_log),
        "flush_log": None if runtime is None else list(runtime.flush_log),
        "step_times": step_times,
        "grad_norms": grad_norms,  # engine.get_global_grad_norm() after each step (inf for one that overflowed)
        "first_step_s": first_step_s,
        "first_step": first_step,  # 0, or the step load_checkpoint resumed at
        "global_steps": engine.global_steps,
        "installed": owner_reduce.is_installed(),  # whether owner_reduce.install() had run in this process by the end
        "summary": None if runtime is None else runtime.owner_map.summary(),
        "timings": timings,
        "full_grads": full_grads,
        "log": None if captured is None else captured.close(),
    }
