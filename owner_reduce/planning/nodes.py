"""How many nodes the ranks run on and how many ranks each holds: from the host names every rank reported at init,
checked against what the launcher's and SLURM's variables say. Pure: lists in, a layout and its warnings out.

Why the hosts decide: ranks on one host share its NVLink, whatever a launcher says. A variable can be missing (a bare
``srun`` with one GPU bound per task sets no ``LOCAL_WORLD_SIZE``, and each rank sees one GPU, so the count of visible
GPUs says one rank per node) or describe another grouping (two launches on one host, each with its own
``LOCAL_WORLD_SIZE``). The host names, exchanged once in the runtime's init-time agreement (``runtime.agreement``), are
the truest source under any launcher. A variable that disagrees with them is named in a warning with both counts,
and the hosts' count is used; one that agrees is named as agreeing in the settings line.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .wording import GROUPS_SHOWN, count_noun, ranks_phrase

HOSTS = "host names"
# Ranks on this node as a launcher sets it: torchrun, DeepSpeed's launcher, Open MPI (index = the agreement's code).
LAUNCHER_VARS: tuple[str, ...] = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
# srun's tasks per node of the job step ("8(x64)", "4,2", "2(x3),1"), indexed by SLURM_NODEID; the job's
# SLURM_TASKS_PER_NODE where the step's is unset (sbatch without srun).
SLURM_VARS: tuple[str, ...] = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
SLURM_NODE_ID_VAR = "SLURM_NODEID"
_SLURM_ENTRY = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
HOST_NAME_BYTES = 64  # a Linux host name's limit (HOST_NAME_MAX); a longer one is cut there in messages only
HOST_INTS = HOST_NAME_BYTES // 8  # the agreement's integers that carry a host name, 8 bytes each


def pack_host(name: str) -> list[int]:
    """A host name as ``HOST_INTS`` signed 64-bit integers (the agreement gathers integers): its first
    ``HOST_NAME_BYTES`` bytes of UTF-8, zero-padded."""
    raw = name.encode()[:HOST_NAME_BYTES].ljust(HOST_NAME_BYTES, b"\0")
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, HOST_NAME_BYTES, 8)]


def unpack_host(ints: Sequence[int]) -> str:
    """``pack_host``'s name back (a name cut inside a UTF-8 sequence ends in a replacement character)."""
    raw = b"".join(int(i).to_bytes(8, "little", signed=True) for i in ints)
    return raw.rstrip(b"\0").decode(errors="replace")


def slurm_tasks_on_node(spec: str, node_id: int) -> int:
    """Tasks on node ``node_id`` of a SLURM tasks-per-node list (``"8(x64)"``, ``"4,2"``, ``"2(x3),1"``); 0 where the
    list is malformed or shorter than ``node_id``."""
    at = 0
    for entry in spec.strip().split(","):
        match = _SLURM_ENTRY.match(entry.strip())
        if match is None:
            return 0
        tasks, repeat = int(match.group(1)), int(match.group(2) or 1)
        if node_id < at + repeat:
            return tasks
        at += repeat
    return 0


@dataclass(frozen=True)
class NodeLayout:
    """The nodes as the host names give them: ``per_host`` the ranks of each host, in the order hosts first appear
    (by rank); ``source`` what the settings line says the count came from; ``warnings`` one per variable that
    disagrees with the hosts."""

    world_size: int
    per_host: tuple[int, ...]
    source: str = HOSTS
    warnings: tuple[str, ...] = ()

    @property
    def nodes(self) -> int:
        return len(self.per_host)

    @property
    def ranks_per_node(self) -> int:
        """The most ranks any host holds (the cost model's node; uneven hosts form no two-level flush anyway)."""
        return max(self.per_host, default=0)

    @property
    def even(self) -> bool:
        return len(set(self.per_host)) <= 1

    def describe(self) -> str:
        """``64 nodes x 8 (host names = LOCAL_WORLD_SIZE)``, or ``3 nodes x 1-4 ranks (host names)`` where uneven."""
        nodes = f"{self.nodes} node{'s' if self.nodes != 1 else ''}"
        per = (str(self.ranks_per_node) if self.even
               else f"{min(self.per_host)}-{self.ranks_per_node} ranks")
        return f"{nodes} x {per} ({self.source})"


def _hosts_phrase(per_host: Sequence[int]) -> str:
    counts = sorted(set(per_host))
    if len(counts) == 1:
        return f"{counts[0]} ranks on each of {len(per_host)} host{'s' if len(per_host) != 1 else ''}"
    return f"{counts[0]}-{counts[-1]} ranks per host on {len(per_host)} hosts"


def _claims(wrong: dict[int, tuple[str, int]]) -> str:
    """``LOCAL_WORLD_SIZE=4 on ranks 0-7``, grouped by what each rank's variable says (capped)."""
    groups: dict[tuple[str, int], list[int]] = {}
    for rank, claim in sorted(wrong.items()):
        groups.setdefault(claim, []).append(rank)
    items = list(groups.items())
    text = ", ".join(f"{name}={value} on {ranks_phrase(ranks)}" for (name, value), ranks in items[:GROUPS_SHOWN])
    others = [r for _, ranks in items[GROUPS_SHOWN:] for r in ranks]
    if others:
        text += f" and {count_noun(len(items) - GROUPS_SHOWN, 'other value')} on {ranks_phrase(others)}"
    return text


def node_layout(hosts: Sequence[str], launcher: Sequence[tuple[int, int]] = (),
                slurm: Sequence[tuple[int, int]] = ()) -> NodeLayout:
    """The layout from every rank's host name (by rank), checked against every rank's launcher variable and SLURM's
    (each ``(index in LAUNCHER_VARS or SLURM_VARS, value)``, index -1 or value 0: unset). The same lists on every rank
    give the same layout and the same warnings (rank 0 logs them)."""
    count = Counter(hosts)
    per_host = tuple(count.values())  # insertion order: the order hosts first appear by rank
    agreeing: list[str] = []
    warnings: list[str] = []
    for names, claims in ((LAUNCHER_VARS, launcher), (SLURM_VARS, slurm)):
        said = [(names[i], v) if 0 <= i < len(names) and v > 0 else None for i, v in claims]
        if not any(said):
            continue
        wrong = {r: s for r, s in enumerate(said) if s is not None and s[1] != count[hosts[r]]}
        if not wrong:
            agreeing += sorted({s[0] for s in said if s is not None})
            continue
        warnings.append(f"owner_reduce: ranks per node: the host names give {_hosts_phrase(per_host)}, but "
                        f"{_claims(wrong)}; the host names' count is used (ranks on one host share its NVLink whatever "
                        f"a variable says)")
    source = HOSTS
    if agreeing:
        source += " = " + " = ".join(dict.fromkeys(agreeing))
    elif warnings:
        source += ", not the variables"
    return NodeLayout(len(hosts), per_host, source, tuple(warnings))


__all__ = ["HOST_INTS", "HOST_NAME_BYTES", "HOSTS", "LAUNCHER_VARS", "SLURM_NODE_ID_VAR", "SLURM_VARS", "NodeLayout",
           "node_layout", "pack_host", "slurm_tasks_on_node", "unpack_host"]
