"""The vocabulary every layer speaks, defined once: the calls a flush issues, the communicators they run on, the
algorithms a flush may run, and the explicit tables that map a call kind at each site.

Why: the call kinds used to be defined in four modules in two spellings (``"allreduce"`` in plans and the probe's
``algo=``, ``all_reduce`` in the collective log and the communicators' methods, ``allReduce`` in NCCL), and a site
that met a kind it did not handle issued it as another (``else: comm.all_reduce(...)``). Here each kind is one enum
member that carries its other spellings, and each site that maps kinds looks them up in a ``KindTable``, which
raises ``UnknownCallKindError`` naming the kind and the site for a kind it lacks (Note (no fall-through)).

The members are their strings (``_Name``): equal to them, hashed, printed, formatted and repr'd as them, so plans,
logs, JSON and reprs read exactly as before and a plain string still looks a member up. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from enum import Enum
from typing import Any, Generic, TypeVar

from ..errors import UnknownCallKindError

__all__ = ["ALGOS", "ALLREDUCE", "COLLECTIVES", "HANDOFF", "KINDS", "LEVELS", "NATIVE", "NODE", "NODE_HANDOFF", "RAIL",
           "REDUCE", "REDUCE_SCATTER", "TWO_LEVEL", "WORLD", "Algo", "CallKind", "KindTable", "Level",
           "UnknownCallKindError"]


class _Name(str, Enum):
    """An enum member that is its string everywhere it shows (Python 3.10 and later alike: ``str()`` and ``format()``
    of a mixed-in enum changed in 3.11, so both are spelled out; ``repr`` too, so a plan's repr is unchanged)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return repr(self.value)


class CallKind(_Name):
    """A call a flush issues (``collectives.Collective.kind``), in the order the probe's ``algo=`` names them.

    ``log``: its name in the collective log and the name of the communicator method that issues it (``ReduceComm``);
    ``nccl``: NCCL's function. ``handoff`` is one grouped send/recv round (``ReduceComm.send`` / ``recv``; NCCL's
    ``ncclSend`` / ``ncclRecv``), a marker among the calls whose moves are the layout's transfers."""

    log: str
    nccl: str

    REDUCE_SCATTER = ("reduce_scatter", "reduce_scatter", "reduceScatter")
    HANDOFF = ("handoff", "handoff", "send/recv")
    REDUCE = ("reduce", "reduce", "reduce")
    ALLREDUCE = ("allreduce", "all_reduce", "allReduce")

    def __new__(cls, value: str, log: str, nccl: str) -> CallKind:
        member = str.__new__(cls, value)
        member._value_ = value
        member.log = log
        member.nccl = nccl
        return member


class Level(_Name):
    """The communicator a call runs on (``Collective.comm``): ``world`` the data-parallel one; ``node`` the ranks of
    this rank's node; ``rail`` the ranks of every node with this rank's local rank; ``node_handoff`` a node's ranks on
    a communicator of their own that only the rail stream uses (``two_level`` Note (balanced rails)). ``role``: the
    communicator's name in messages (``ReduceComm.role``)."""

    role: str

    WORLD = ("world", "data-parallel")
    NODE = ("node", "node")
    RAIL = ("rail", "rail")
    NODE_HANDOFF = ("node_handoff", "node hand-off")

    def __new__(cls, value: str, role: str) -> Level:
        member = str.__new__(cls, value)
        member._value_ = value
        member.role = role
        return member


class Algo(_Name):
    """The algorithms this package defines (``planning.algorithms``, one module each; the registry holds their order
    and which can be forced). ``native`` is no call kind: one AllReduce per gradient in one group, as z1.cpp issues;
    ``two_level`` a ReduceScatter in each node, then each owner's region across nodes on its rail."""

    REDUCE_SCATTER = "reduce_scatter"
    REDUCE = "reduce"
    ALLREDUCE = "allreduce"
    HANDOFF = "handoff"
    NATIVE = "native"
    TWO_LEVEL = "two_level"


REDUCE_SCATTER, HANDOFF, REDUCE, ALLREDUCE = CallKind.REDUCE_SCATTER, CallKind.HANDOFF, CallKind.REDUCE, \
    CallKind.ALLREDUCE
WORLD, NODE, RAIL, NODE_HANDOFF = Level.WORLD, Level.NODE, Level.RAIL, Level.NODE_HANDOFF
NATIVE, TWO_LEVEL = Algo.NATIVE, Algo.TWO_LEVEL
KINDS: tuple[CallKind, ...] = tuple(CallKind)  # the order the probe's algo= names them in (``algo_of``)
LEVELS: tuple[Level, ...] = tuple(Level)
ALGOS: tuple[Algo, ...] = tuple(Algo)
# NCCL's collectives among the kinds (the hand-off is sends and receives), in the order NCCL's planner takes its
# functions (``collective_time.aggregates``) and a calibration file lists its fits.
COLLECTIVES: tuple[CallKind, ...] = (ALLREDUCE, REDUCE, REDUCE_SCATTER)




K = TypeVar("K")
V = TypeVar("V")


class KindTable(Mapping[K, V], Generic[K, V]):
    """One site's explicit table keyed by call kind (or by (level, kind)): a key it lacks raises
    ``UnknownCallKindError`` naming ``site``. ``get`` and ``in`` ask without raising. ``complete_for``: the keys it
    must hold, checked when it is made (a kind added to the vocabulary then fails at import, not at its first use)."""

    __slots__ = ("site", "_entries")

    def __init__(self, site: str, entries: Mapping[K, V], complete_for: Iterable[K] = ()) -> None:
        self.site = site
        self._entries = dict(entries)
        missing = [k for k in complete_for if k not in self._entries]
        if missing:
            raise UnknownCallKindError(missing[0] if len(missing) == 1 else tuple(missing), site)

    def __getitem__(self, key: K) -> V:
        try:
            return self._entries[key]
        except KeyError:
            raise UnknownCallKindError(key, self.site) from None

    def get(self, key: Any, default: Any = None) -> Any:
        return self._entries.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"KindTable({self.site!r}, {self._entries!r})"


# The collective log's names (and the profiler ranges' kinds): a data-parallel call by its kind's ``log``, a call on a
# node, rail or node hand-off communicator prefixed by its level; the node hand-off round is ``node_handoff``.
LOG_NAMES: KindTable[tuple[Level, CallKind], str] = KindTable("the collective log (planning.calls.LOG_NAMES)", {
    **{(WORLD, kind): kind.log for kind in KINDS},
    (NODE, REDUCE_SCATTER): "node_reduce_scatter", (NODE, REDUCE): "node_reduce",
    (RAIL, REDUCE): "rail_reduce", (RAIL, REDUCE_SCATTER): "rail_reduce_scatter", (RAIL, HANDOFF): "rail_handoff",
    (NODE_HANDOFF, HANDOFF): "node_handoff"})

NOTES = """
Note (no fall-through): every site that turns a call kind into something (the executor into a communicator's method,
NCCL's cost model into its algorithms and steps, the calibration into a fit, the sizing into an issued call, the log
into a name) looks it up in a ``KindTable`` of its own that names the site; a kind the table lacks raises
``UnknownCallKindError`` there, never an ``else:`` that issues, costs or logs it as another kind. A kind added to
``CallKind`` therefore fails loudly at the first site that lacks it, or at import where a table must be complete
(``complete_for``); ``tests/pure/test_calls.py`` sends a kind no table holds to each site.
"""
