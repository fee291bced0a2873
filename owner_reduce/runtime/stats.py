"""What the runtime counts and records: proof that it ran, for tests, the demo and the benchmark.

Why a module of its own: the handle, the placement and the flush each add to the same counters; none of them
should reach into another to do it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

LOG_LEVEL_HINT = 'add "log_level": "info" to the DeepSpeed config'
_hidden_said: set[str] = set()


def emit(line: str, *, even_if_hidden: bool = False) -> None:
    """Log a line of owner_reduce's own (the init, settings, schedule and probe lines) through DeepSpeed's logger at
    INFO, as DeepSpeed logs what a feature does (``log_dist(..., ranks=[0])``); the callers choose the ranks (rank 0,
    the probe's every rank on request). DeepSpeed's default level is WARNING, which hides them: ``say_if_hidden``.
    ``even_if_hidden``: the one line that proves the owner path is on (rank 0's init line) goes out at WARNING where
    INFO is hidden, so that turning the flag on always says what it does.

    Note (whole lines): every rank writes to the same terminal or pipe; the logger's handler writes a record and its
    newline in one write, so another rank's line cannot land inside it.
    """
    from deepspeed.utils import logger

    if even_if_hidden and _info_hidden(logger):
        logger.warning(line)
    else:
        logger.info(line)


def _info_hidden(logger: logging.Logger) -> bool:
    """Whether INFO records are dropped: by the logger's level or by every handler's (DeepSpeed's own handler has a
    level too: ``logger.setLevel`` alone leaves it at WARNING; the config's ``log_level`` sets both)."""
    return not (logger.isEnabledFor(logging.INFO) and any(h.level <= logging.INFO for h in logger.handlers))


def emit_detail(line: str) -> None:
    """What a line leaves out to stay short (the model behind a schedule, every communicator made), at DEBUG."""
    from deepspeed.utils import logger

    logger.debug(line)


def say_if_hidden(what: str) -> bool:
    """Where DeepSpeed's logger hides INFO, one warning (once per process) that ``what`` (lines the user asked for) is
    logged at INFO and how to show it; whether it is hidden. Why: a flag whose only output nobody sees would be a flag
    that silently does nothing."""
    from deepspeed.utils import logger

    if not _info_hidden(logger):
        return False
    if what not in _hidden_said:
        _hidden_said.add(what)
        shown_from = max(logger.getEffectiveLevel(), min((h.level for h in logger.handlers), default=0))
        level = logging.getLevelName(shown_from)
        logger.warning(f"owner_reduce: {what} are logged at INFO, which DeepSpeed's log level ({level}) hides: "
                       f"{LOG_LEVEL_HINT} to see them")
    return True


@dataclass
class RuntimeStats:
    """Counters that prove the runtime ran (tests and benchmarks read them)."""

    reduce_grad_calls: int = 0
    profiling_calls: int = 0
    accumulated_calls: int = 0
    flushes: int = 0
    collectives: int = 0
    reduce_calls: int = 0
    all_reduce_calls: int = 0
    reduce_scatter_calls: int = 0
    handoff_rounds: int = 0  # grouped send/recv rounds after a ReduceScatter
    staged_flushes: int = 0  # off-schedule flushes run as native from the staging buffer (flush.py Note (staging))
    sends: int = 0  # this rank's sends in those rounds
    recvs: int = 0
    scheduled_flushes: int = 0  # flushes laid out in owner order (a learned schedule)
    two_level_flushes: int = 0  # flushes run on the node and rail communicators (``planning.two_level``)
    two_level_stages: int = 0  # their pipeline stages
    node_calls: int = 0  # ReduceScatters and (tail stages) Reduces this rank issued on its node communicator
    rail_calls: int = 0  # Reduces and ReduceScatters this rank issued on its rail communicator
    rail_handoffs: int = 0  # hand-off rounds on its rail (two-level flushes whose rail step is a ReduceScatter)
    node_handoffs: int = 0  # balanced two-level stages in which this rank sent or received on its node hand-off
    node_handoff_sends: int = 0  # its sends there (each a part of an owner region, to that owner)
    node_handoff_recvs: int = 0
    two_level_line: str | None = None  # what rank 0 printed when the node and rail communicators were made
    schedules_learned: int = 0
    schedules_restored: int = 0  # learned from a checkpoint's schedule at a resumed run's first backward
    schedule_fallbacks: int = 0  # backwards that left their schedule and finished in arrival order
    resets: int = 0  # DeepCompile's reset() (each step of its compile schedule): every graph learned again
    reduced_elems: int = 0
    owner_elems: int = 0
    kept_elems: int = 0
    end_backward_calls: int = 0
    trial_steps: int = 0  # backwards that followed a trial's variant in full (the measured guard, ``trial``)
    trial_native_flushes: int = 0  # flushes run as native's calls in place of the model's choice during trials
    trials_decided: int = 0
    trials_replayed: int = 0  # schedules whose verdicts were known (a checkpoint's, a file's, this run's): no trial
    trials_resumed: int = 0  # trials a checkpoint saved under way, gone on with from its step (``trial``)
    measured_overruled: int = 0  # flushes whose model choice the measurement replaced by native's calls
    # The probe's step summary (``exposure``): this rank's numbers per probe step (None: not measured), rank 0's lines.
    exposure_samples: list = field(default_factory=list)
    exposure_lines: list[str] = field(default_factory=list)
    monitor_steps: int = 0  # steps measured for DeepSpeed's monitor (``monitor``): every rank's exchanges
    monitor_events: int = 0  # events rank 0 wrote to it
    init_line: str | None = None  # what rank 0 printed at init
    settings_line: str | None = None  # what rank 0 printed after it: the settings in effect (``planning.settings``)
    schedule_lines: list[str] = field(default_factory=list)  # what rank 0 printed when schedules were learned
    measured_lines: list[str] = field(default_factory=list)  # what rank 0 printed when a trial was decided
    close_lines: list[str] = field(default_factory=list)  # rank 0's warnings: verdicts within the noise, unpinned
    probe_lines: list[str] = field(default_factory=list)  # what this rank logged (rank 0's, or every rank's on request)


class FlushRecord(NamedTuple):
    """What one flush did on this rank (recorded only with ``record_collectives``)."""

    dtype: str
    element_size: int
    reduced_elems: int
    received_elems: int
    kept_elems: int
    owner_elems: int
    calls: int
    algo: str = ""
