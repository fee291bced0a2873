"""The measured guard's verdicts as data: kept with every checkpoint, written to a file, replayed by the next run.

Why: a verdict decides which algorithm adds the ranks' terms of a flush, and different algorithms add them in
different orders (at three or more ranks the last bits differ). A verdict measured anew can differ from run to run
where two variants are close (``measured`` Note (beyond the noise)), so a run resumed from a checkpoint, or a second
run of the same job, would not give the same bits. A ``VerdictBook`` holds every verdict a run decided, per
schedule; the runtime saves it with each checkpoint (``CHECKPOINT_KEY`` in DeepSpeed's client state) and restores it
at ``load_checkpoint``, and the config's ``compile.reduce_to_owner_verdicts: FILE`` replays a book written by an
earlier run (or, where FILE does not exist yet, writes this run's verdicts there): a schedule whose key is in the
book skips its trial and runs the recorded winners, every rank alike. A checkpoint saved during a trial also keeps
that trial under way (``TrialProgress``: ``runtime.trial`` Note (resumed trials)), so that the resumed run goes on
with it.

Note (checkpoint format): ``CHECKPOINT_FORMAT`` (``/2``) holds the verdicts, the schedules as learned and the trials
under way; the previous release's ``/1`` (verdicts and schedules) is read as one with no trial under way. A release
that knows only ``/1`` finds a ``/2`` payload unusable on every rank and says so at ``load_checkpoint`` (its schedules
are learned and measured again); DeepSpeed's own state in the checkpoint is unaffected either way.

Note (key): a schedule's key is the sha256 of its flushes as learned (dtype, gradient ids, sizes, in order) and the
cost model's choice for each, with the world size. The same model, partitioning, bucket size and cost model give the
same key; anything that changes a flush or a choice gives another key, and that schedule is measured again.
Note (agreement): every rank must replay the same verdicts, so ranks compare the book's ``digest()`` (at init for a
file, at ``load_checkpoint`` for a checkpoint's) and refuse together where they differ.
Pure: no torch, no communication.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .json_digest import canonical_digest
from .json_fields import FieldCheck, parse_json, read_text
from .measured import TrialFlush, Verdict

FORMAT = "owner_reduce.verdicts/1"
CHECKPOINT_KEY = "owner_reduce"  # in the checkpoint's client state (``engine.save_checkpoint``): ``checkpoint_payload``
CHECKPOINT_FORMAT = "owner_reduce.checkpoint/2"  # /1 (no trials under way) is read too: ``parse_checkpoint_payload``
CHECKPOINT_FORMAT_1 = "owner_reduce.checkpoint/1"
KEY_CHARS = 16


def schedule_key(world_size: int, flushes: Sequence[tuple[str, Sequence[int], Sequence[int], str]]) -> str:
    """Note (key): ``flushes`` are (dtype name, gradient ids, sizes, the model's algorithm) in schedule order."""
    canonical = json.dumps([world_size, [[d, list(ids), list(numels), algo] for d, ids, numels, algo in flushes]],
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:KEY_CHARS]


@dataclass(frozen=True)
class ScheduleVerdicts:
    """One schedule's decided trial: its trial flushes in order, each with the verdict, over ``rounds`` steps."""

    key: str
    rounds: int
    flushes: tuple[TrialFlush, ...]

    @property
    def verdicts(self) -> tuple[Verdict, ...]:
        return tuple(f.verdict for f in self.flushes)

    def matches(self, numbers_and_algos: Sequence[tuple[int, str]]) -> bool:
        """The trial flushes of a schedule with this key are the recorded ones (number and algorithm)."""
        return [(f.number, f.algo) for f in self.flushes] == list(numbers_and_algos)


@dataclass(frozen=True)
class VerdictBook:
    """Every decided schedule of one job at ``world_size`` ranks, in the order they were decided."""

    world_size: int
    schedules: tuple[ScheduleVerdicts, ...] = ()

    def find(self, key: str) -> ScheduleVerdicts | None:
        return next((s for s in self.schedules if s.key == key), None)

    def with_schedule(self, decided: ScheduleVerdicts) -> VerdictBook:
        """This book with ``decided`` in place of any earlier verdicts of the same schedule."""
        kept = tuple(s for s in self.schedules if s.key != decided.key)
        return VerdictBook(self.world_size, (*kept, decided))

    def merged(self, other: VerdictBook) -> VerdictBook:
        """This book with every schedule of ``other`` (``other``'s verdicts win for a schedule both hold)."""
        book = self
        for decided in other.schedules:
            book = book.with_schedule(decided)
        return book

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "world_size": self.world_size, "schedules": [
            {"key": s.key, "rounds": s.rounds, "flushes": [
                {"number": f.number, "algo": f.algo, "modelled_us": f.modelled_us,
                 "native_modelled_us": f.native_modelled_us, "model_us": f.verdict.model_us,
                 "native_us": f.verdict.native_us, "native_wins": f.verdict.native_wins} for f in s.flushes]}
            for s in self.schedules]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def digest(self) -> str:
        """sha256 of the canonical JSON, first 12 hex digits: what ranks compare (Note (agreement))."""
        return canonical_digest(self.to_dict())

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> VerdictBook:
        """Parse and validate; a ValueError names ``source`` and the key at fault."""
        v = FieldCheck("verdicts", source, FORMAT)
        v.mapping(data, "")
        if data.get("format") != FORMAT:
            v.fail("format", f"must be {FORMAT!r}", data.get("format"))
        world_size = v.field(data, "world_size", "", v.integer)
        parsed = []
        for i, s in enumerate(v.field(data, "schedules", "", v.listing)):
            at = f"schedules[{i}]."
            flushes = []
            for j, f in enumerate(v.field(s, "flushes", at, v.listing)):
                fat = f"{at}flushes[{j}]."
                verdict = Verdict(v.field(f, "model_us", fat, v.finite), v.field(f, "native_us", fat, v.finite),
                                  v.field(f, "native_wins", fat, v.boolean))
                flushes.append(TrialFlush(v.field(f, "number", fat, v.integer), v.field(f, "algo", fat, v.string),
                                          v.field(f, "modelled_us", fat, v.finite),
                                          v.field(f, "native_modelled_us", fat, v.finite), verdict))
            parsed.append(ScheduleVerdicts(v.field(s, "key", at, v.string), v.field(s, "rounds", at, v.integer),
                                           tuple(flushes)))
        return cls(world_size, tuple(parsed))

    @classmethod
    def from_json(cls, text: str, source: str = "<text>") -> VerdictBook:
        return cls.from_dict(parse_json(text, "verdicts", source), source)

    def check_world_size(self, world_size: int) -> None:
        """Verdicts are measured at one world size (a key includes it): refuse another."""
        if world_size != self.world_size:
            raise ValueError(f"owner_reduce: the verdicts were measured on {self.world_size} ranks, this run has "
                             f"{world_size}")


def load_verdicts(path: str | Path) -> VerdictBook:
    """Read and validate a verdict file; errors name the file."""
    p = Path(path)
    return VerdictBook.from_json(read_text(p, "verdicts"), source=str(p))


def write_verdicts(path: str | Path, book: VerdictBook) -> None:
    """Write ``book`` to ``path`` whole or not at all (a temporary file renamed over it): a run that stops while
    writing never leaves a half file for the next run to replay."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(book.to_json())
    tmp.replace(p)


# A schedule as learned (``runtime.placement`` Note (resumed schedules)): (dtype name, gradient ids, sizes) per flush.
Recording = list[tuple[str, tuple[int, ...], tuple[int, ...]]]


@dataclass(frozen=True)
class TrialProgress:
    """A trial under way when a checkpoint was saved (``runtime.trial`` Note (resumed trials)): its schedule's key,
    the backwards that followed a variant in full (``steps``; the next one runs variant ``steps % 2``), ``rounds``,
    and per trial flush its number and algorithm with the model's and native's step times so far in nanoseconds, each
    step timed by its slowest rank (``measured.slowest_progress``)."""

    key: str
    steps: int
    rounds: int
    flushes: tuple[tuple[int, str, tuple[int, ...], tuple[int, ...]], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "steps": self.steps, "rounds": self.rounds,
                "flushes": [{"number": n, "algo": a, "model_ns": list(m), "native_ns": list(v)}
                            for n, a, m, v in self.flushes]}

    @classmethod
    def from_dict(cls, data: Any, v: FieldCheck, at: str) -> TrialProgress:
        """Validated: the sample counts are what ``steps`` alternating backwards give (model first), short of a
        verdict (a trial with every sample is decided in the backward that completes it, before any save)."""
        v.mapping(data, at.rstrip("."))
        v.keys(data, at.rstrip("."), ("key", "steps", "rounds", "flushes"), ())
        rounds = v.integer(v.get(data, "rounds", at), at + "rounds", 1)
        steps = v.integer(v.get(data, "steps", at), at + "steps", 0)
        if steps >= 2 * rounds:
            v.fail(at + "steps", f"must be below {2 * rounds} (a trial of {rounds} rounds is decided at its step "
                                 f"{2 * rounds})", steps)
        flushes = []
        for j, f in enumerate(v.field(data, "flushes", at, v.listing)):
            fat = f"{at}flushes[{j}]."
            times = []
            for name, count in (("model_ns", (steps + 1) // 2), ("native_ns", steps // 2)):
                values = v.field(f, name, fat, v.listing)
                if len(values) != count:
                    v.fail(fat + name, f"must hold {count} step times after {steps} trial steps", values)
                times.append(tuple(v.integer(x, f"{fat}{name}[{k}]", 0) for k, x in enumerate(values)))
            flushes.append((v.field(f, "number", fat, v.integer), v.field(f, "algo", fat, v.string), *times))
        return cls(v.field(data, "key", at, v.string), steps, rounds, tuple(flushes))


def checkpoint_payload(book: VerdictBook | None, recordings: Sequence[Recording],
                       trials: Sequence[TrialProgress] = ()) -> dict[str, Any]:
    """What a checkpoint keeps of the runtime: the verdicts, every schedule as learned, every trial under way."""
    return {"format": CHECKPOINT_FORMAT, "verdicts": None if book is None else book.to_dict(),
            "schedules": [[[d, list(ids), list(numels)] for d, ids, numels in r] for r in recordings],
            "trials": [t.to_dict() for t in trials]}


def parse_checkpoint_payload(data: Any, source: str
                             ) -> tuple[VerdictBook | None, list[Recording], tuple[TrialProgress, ...]]:
    """``checkpoint_payload``'s data back; a ValueError names ``source`` and what is wrong. A payload of the previous
    release (``CHECKPOINT_FORMAT_1``: verdicts and schedules) reads as one without trials under way."""
    known = (CHECKPOINT_FORMAT, CHECKPOINT_FORMAT_1)
    if not isinstance(data, Mapping) or data.get("format") not in known:
        got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
        raise ValueError(f"owner_reduce: {source}: '{CHECKPOINT_KEY}' is not {CHECKPOINT_FORMAT} or "
                         f"{CHECKPOINT_FORMAT_1} data (format {got!r})")
    book = None if data.get("verdicts") is None else VerdictBook.from_dict(data["verdicts"], source)
    recordings: list[Recording] = []
    try:
        for r in data["schedules"]:
            recordings.append([(str(d), tuple(int(i) for i in ids), tuple(int(n) for n in numels))
                               for d, ids, numels in r])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"owner_reduce: {source}: its schedules are not {data['format']} data "
                         f"({type(error).__name__}: {error})") from error
    trials: tuple[TrialProgress, ...] = ()
    if data["format"] == CHECKPOINT_FORMAT:
        v = FieldCheck("checkpoint state", source, CHECKPOINT_FORMAT)
        trials = tuple(TrialProgress.from_dict(t, v, f"trials[{i}].")
                       for i, t in enumerate(v.field(data, "trials", "", v.listing)))
    return book, recordings, trials


def payload_digest(data: Any) -> str:
    """sha256 of a payload's canonical JSON, 12 hex digits: what ranks compare at ``load_checkpoint``."""
    return canonical_digest(data)
