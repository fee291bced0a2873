"""The init-time agreement: every rank's facts in one all_gather, every rank refusing together where they differ.

Why at init, in one gather: every flush's calls must be the same on every rank (NCCL matches them), so everything a
flush depends on (the settings, the bucket size, the owner map, the files the config names) must be the same
everywhere, and the cost model's topology must come from every rank's facts (ranks per node from the host names, GPU
generation, NVLinks), never from one rank's environment. And a rank that cannot use its input must not raise alone
while the others wait in the first collective: see Note (every rank refuses together).

The row is ``AgreementRow``, a named record; the gather carries it as integers (``pack``/``unpack``: the field order
is the wire order, and ``PROTOCOL`` changes with it). What every rank learns is an ``Agreement``.

Note (every rank refuses together): whatever this rank could not use (a file its config names that it cannot read, one
of another world size, ``NCCL_COMM_BLOCKING`` other than 1: ``planning.rank_inputs``) is not raised here but gathered:
every rank then raises the same ``OwnerReduceMismatchError`` naming each failing rank, its key or variable and its
reason, within init's deadline (the gathers are the communicator's, bounded), instead of one rank raising alone while
the others wait for it. Ranks in messages are folded and capped (``planning.wording``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from ..errors import OwnerReduceMismatchError
from ..planning.calibration import format_fits
from ..planning.flags import describe_flag_disagreement, pack_flags
from ..planning.flush_choice import Topology, agreed_topology
from ..planning.nodes import HOST_INTS, NodeLayout, node_layout, pack_host, unpack_host
from ..planning.owner_map import OwnerMap
from ..planning.rank_inputs import RankInputs
from ..planning.settings import ALGO, ALGO_VALUES, CALIBRATION, TIMEOUT, VERDICTS, OwnerReduceSettings, key_name
from ..planning.wording import by_reason, by_value, ranks_phrase
from . import stall_report
from .comm import ReduceComm
from .stats import emit, emit_detail
from .topology import (
    host_digest,
    host_name,
    launcher_ranks_per_node,
    local_rank,
    nvlinks,
    slurm_ranks_on_node,
    sm_major,
)

PROTOCOL = 8  # the row's version: ranks that run different ones refuse before reading any other field
PROBLEM_TEXT_LIMIT = 600  # bytes of a rank's reasons that reach the other ranks (``_gather_texts``)


@dataclass(frozen=True)
class AgreementRow:
    """One rank's facts, as the gather carries them (``pack``: this order, the host name last as ``HOST_INTS``
    integers, ``planning.nodes.pack_host``). The first group must be the same on every rank (``MUST_AGREE``); the
    others describe the rank and may differ."""

    protocol: int  # ``PROTOCOL``
    flags: int  # the boolean keys (``planning.flags.pack_flags``)
    bucket: int  # reduce_bucket_size
    map_digest: int  # the owner map's digest, its first 15 hex digits
    algo: int  # compile.reduce_to_owner_algo, as its index in ``ALGO_VALUES``
    map_problems: int  # where this rank's optimizer contradicts the owner map (should be 0)
    launcher_ranks: int  # ranks on this node as the launcher's variable says (0: unset)
    sm: int  # the GPU's compute capability major (0: no GPU)
    timeout_ms: int  # compile.reduce_to_owner_timeout_s in ms (0: unset)
    calibration: int  # the calibration's digest (0: none)
    local_rank: int
    host_digest: int
    nvlinks: int  # this GPU's NVLinks (0: unknown)
    verdicts: int  # compile.reduce_to_owner_verdicts: 0 unset, -1 a file to write, else the replayed file's digest
    reasons: int  # the length of this rank's reasons (``_gather_texts`` gathers them where any rank has one)
    launcher_var: int  # which of ``planning.nodes.LAUNCHER_VARS`` set ``launcher_ranks`` (-1: none)
    slurm_var: int  # which of ``planning.nodes.SLURM_VARS`` set ``slurm_ranks`` (-1: none)
    slurm_ranks: int  # SLURM's tasks on this node (0: outside SLURM)
    global_rank: int
    monitor_every: int  # DeepSpeed's monitor's steps between writes (0: none)
    runtime_number: int  # this process's runtime number: rank 0's names the stall report's keys (``stall_report``)
    host: tuple[int, ...]  # the host name (``planning.nodes.pack_host``)

    def pack(self) -> list[int]:
        """The integers the gather carries."""
        return [*(getattr(self, name) for name in SCALARS), *self.host]

    @classmethod
    def unpack(cls, row: Sequence[int]) -> AgreementRow:
        """A gathered row back as a record (its length checked by ``agree`` first)."""
        return cls(*row[:HOST_AT], host=tuple(row[HOST_AT:]))


SCALARS: tuple[str, ...] = tuple(f.name for f in fields(AgreementRow) if f.name != "host")
HOST_AT = len(SCALARS)  # the row's first integer of the host name
ROW_LENGTH = HOST_AT + HOST_INTS


def _algo_name(index: int) -> str:
    return ALGO_VALUES[index] if 0 <= index < len(ALGO_VALUES) else str(index)


def _verdict_state(state: int) -> str:
    """An agreement row's ``compile.reduce_to_owner_verdicts``: unset, a file to write, or the digest of the file
    replayed."""
    return "unset" if state == 0 else "a file to write" if state == -1 else f"verdicts {state:012x}"


# The fields every rank must share (``flags`` is said per key: ``_flag_sentences``), in row order, each with the start
# of its sentence and how a value reads in it; ranks are folded by value (``planning.wording.by_value``).
MUST_AGREE: tuple[tuple[str, str, Callable[[int], str] | None], ...] = (
    ("bucket", "reduce_bucket_size differs across ranks: ", None),
    ("map_digest", "the owner map differs across ranks: ", lambda d: f"{d:015x}"),
    ("algo", f"{key_name(ALGO)} differs across ranks: ", _algo_name),
    ("timeout_ms", f"{key_name(TIMEOUT)} differs across ranks: ", lambda ms: f"{ms / 1000:g} s" if ms else "unset"),
    ("calibration", f"{key_name(CALIBRATION)} names different calibrations across ranks: ",
     lambda d: f"{d:012x}" if d else "none"),
    ("verdicts", f"{key_name(VERDICTS)} differs across ranks: ", _verdict_state),
    ("monitor_every", "DeepSpeed's monitor (steps_per_print with a monitor enabled) differs across ranks: ",
     lambda n: f"every {n} steps" if n else "off"),
)


def _flag_sentences(packed: list[int]) -> list[str]:
    """One sentence per boolean key that differs, or one for the packed integers (an unknown flag bit)."""
    if len(set(packed)) == 1:
        return []
    return describe_flag_disagreement(packed) or [f"flags differ across ranks: {by_value(packed)}"]


def differences(rows: Sequence[AgreementRow]) -> list[tuple[str, str]]:
    """(field, sentence) for each field of ``MUST_AGREE`` (and ``flags``) whose value differs across ranks, in row
    order."""
    found = [("flags", sentence) for sentence in _flag_sentences([row.flags for row in rows])]
    for name, start, text in MUST_AGREE:
        values = [getattr(row, name) for row in rows]
        if len(set(values)) > 1:
            found.append((name, start + (by_value(values) if text is None else by_value(values, text))))
    return found


@dataclass(frozen=True)
class Agreement:
    """What every rank learned from the gather, the same on every rank: each rank's row (by data-parallel rank), the
    hosts, the nodes they form and the topology the cost model uses (None: one rank, nothing to cost)."""

    rows: tuple[AgreementRow, ...]
    hosts: tuple[str, ...]
    node_layout: NodeLayout
    topology: Topology | None

    @property
    def global_ranks(self) -> list[int]:
        return [row.global_rank for row in self.rows]

    @property
    def local_facts(self) -> list[tuple[int, int]]:
        """Every rank's (local rank, host digest): whether the ranks are in launcher order (``levels``)."""
        return [(row.local_rank, row.host_digest) for row in self.rows]

    @property
    def stall_keys(self) -> str:
        """The stall report's keys in the store: this runtime's, every rank alike (rank 0's global rank and number)."""
        return f"{stall_report.KEY_PREFIX}/{self.rows[0].global_rank}/{self.rows[0].runtime_number}"


def agree(comm: ReduceComm, settings: OwnerReduceSettings, owner_map: OwnerMap, inputs: RankInputs,
          map_problems: tuple[str, ...], bucket_size: int, monitor_every: int) -> Agreement:
    """One all_gather of this rank's ``AgreementRow`` (29 integers), and a second one of every rank's reasons where
    any rank has one; every rank raises ``OwnerReduceMismatchError`` on any difference or reason, so no rank is left
    hanging (Note (every rank refuses together)). Rank 0 says where a launcher's variable disagrees with the hosts
    (``planning.nodes``), and the calibration's fits where one is costed on."""
    calibration = inputs.calibration
    verdict_file = inputs.verdicts
    reasons = [reason for _, reason in inputs.problems]
    for key, checked in ((CALIBRATION, calibration), (VERDICTS, verdict_file)):
        try:
            if checked is not None:
                checked.check_world_size(comm.world_size)
        except ValueError as error:
            reasons.append(f"{key_name(key)}: {str(error).removeprefix('owner_reduce: ')}")
    reason_bytes = "; ".join(reasons).encode()[:PROBLEM_TEXT_LIMIT]
    launcher_var, launcher_count = launcher_ranks_per_node()
    slurm_var, slurm_count = slurm_ranks_on_node()
    host = host_name()
    mine = AgreementRow(
        protocol=PROTOCOL, flags=pack_flags(settings.flags), bucket=bucket_size,
        map_digest=int(owner_map.digest()[:15], 16), algo=ALGO_VALUES.index(settings.algo),
        map_problems=len(map_problems), launcher_ranks=launcher_count, sm=sm_major(),
        timeout_ms=round(settings.timeout_s * 1000) if settings.timeout_s is not None else 0,
        calibration=int(calibration.digest(), 16) if calibration is not None else 0, local_rank=local_rank(),
        host_digest=host_digest(host), nvlinks=nvlinks(),
        verdicts=(int(verdict_file.digest(), 16) if verdict_file is not None
                  else -1 if inputs.verdicts_path is not None else 0),
        reasons=len(reason_bytes), launcher_var=launcher_var, slurm_var=slurm_var, slurm_ranks=slurm_count,
        global_rank=comm.global_rank, monitor_every=monitor_every, runtime_number=stall_report.next_sequence(),
        host=tuple(pack_host(host)))
    gathered = comm.all_gather_ints(mine.pack())
    if len({row[0] for row in gathered}) > 1 or len({len(row) for row in gathered}) > 1:
        raise OwnerReduceMismatchError(f"owner_reduce on rank {comm.rank}: refusing to start: ranks run different "
                                       f"owner_reduce versions (agreement protocols "
                                       f"{sorted({row[0] for row in gathered})})", ("protocol",))
    rows = [AgreementRow.unpack(row) for row in gathered]
    problems = by_reason(_gather_texts(comm, reason_bytes, [row.reasons for row in rows]))
    differ = differences(rows)
    problems += [sentence for _, sentence in differ]
    bad_ranks = [r for r, row in enumerate(rows) if row.map_problems]
    if bad_ranks:
        problems.append(f"the owner map contradicts the optimizer on {ranks_phrase(bad_ranks)}"
                        + (f": {list(map_problems)[:3]}" if map_problems else ""))
    if problems:
        raise OwnerReduceMismatchError(f"owner_reduce on rank {comm.rank}: refusing to start: " + "; ".join(problems),
                                       tuple(dict.fromkeys(name for name, _ in differ)))
    hosts = tuple(unpack_host(row.host) for row in rows)
    layout = node_layout(list(hosts), [(row.launcher_var, row.launcher_ranks) for row in rows],
                         [(row.slurm_var, row.slurm_ranks) for row in rows])
    if comm.rank == 0 and layout.warnings:
        from deepspeed.utils import logger

        for warning in layout.warnings:
            logger.warning(warning)
    topology = agreed_topology(comm.world_size, [layout.ranks_per_node], [row.sm for row in rows],
                               [row.nvlinks for row in rows])
    if calibration is not None and topology is not None and comm.rank == 0:
        lines = format_fits(calibration)
        emit(lines[0])
        for line in lines[1:]:
            emit_detail(line)
    return Agreement(tuple(rows), hosts, layout, topology)


def _gather_texts(comm: ReduceComm, mine: bytes, lengths: list[int]) -> list[str]:
    """Every rank's text (its reasons), gathered only where some rank has one: every rank knows ``lengths`` from the
    agreement's rows, so every rank takes the same branch. As integers (the communicator gathers those)."""
    width = max(lengths)
    if width == 0:
        return [""] * len(lengths)
    rows = comm.all_gather_ints(list(mine.ljust(width, b"\0")))
    return [bytes(row[:n]).decode(errors="replace") for row, n in zip(rows, lengths, strict=True)]
