"""Every error class of the package derives from ``OwnerReduceError``, keeps the built-in base users catch, and survives
a pickle round trip with its message and fields (``owner_reduce.errors`` Note (errors cross processes)).

The classes are found by walking the package, so a class added without the base, or one whose ``__init__`` a pickle
cannot call, fails here. Pure: no process group, no DeepSpeed engine."""

from __future__ import annotations

import ast
import importlib
import pickle
from pathlib import Path
from typing import Any

import pytest

import owner_reduce
from owner_reduce.errors import OwnerReduceError

PACKAGE = Path(owner_reduce.__file__).resolve().parent

# The built-in base each class had before ``OwnerReduceError`` (an ``except ValueError`` a user wrote still catches
# it); a new class gets its row here.
BUILT_IN_BASE: dict[str, type[BaseException]] = {
    "OwnerReduceConfigError": ValueError,
    "OwnerMapError": ValueError,
    "OwnerReduceMismatchError": RuntimeError,
    "OwnerReduceCommError": RuntimeError,
    "OwnerReduceInstallError": RuntimeError,
    "OwnerReduceInUseError": RuntimeError,
    "UsageError": ValueError,
    "RankFailure": RuntimeError,
    "RankTimeout": TimeoutError,
    "UnknownCallKindError": LookupError,
    "UnknownAlgorithmError": LookupError,
    "UnknownStepError": TypeError,
    "OwnerReduceError": Exception,
}


def _comm_error() -> BaseException:
    from owner_reduce.runtime.deadline import Deadline, OwnerReduceCommError

    return OwnerReduceCommError(rank=3, flush=7, call="reduce_scatter", waited_s=20.25,
                                deadline=Deadline(20.0, "compile.reduce_to_owner_timeout_s"), reason="timed out",
                                dp_rank=1)


# Classes whose ``__init__`` takes more than a message: how the test makes one (with every field set).
MADE: dict[str, Any] = {
    "OwnerReduceCommError": _comm_error,
    "OwnerReduceMismatchError": lambda cls: cls("owner_reduce on rank 0: refusing to start: ...", ("bucket", "algo")),
    "UnknownCallKindError": lambda cls: cls("broadcast", "the collective log"),
    "UnknownAlgorithmError": lambda cls: cls("ring_of_rings", ("native", "reduce")),
    "UnknownStepError": lambda cls: cls(("a", "tuple", "step"), ("Group", "P2pRound")),
}


def error_classes() -> list[type[BaseException]]:
    """Every exception class defined in a module of the package: the modules whose source defines a class are
    imported, and each class defined there that derives from ``BaseException`` is taken."""
    found = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "harness").rglob("*.py")]):
        names = {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}
        if not names:
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        found += [cls for name in sorted(names) if isinstance(cls := getattr(module, name, None), type)
                  and issubclass(cls, BaseException) and cls.__module__ == module.__name__]
    return found


def made(cls: type[BaseException]) -> BaseException:
    maker = MADE.get(cls.__name__)
    if maker is None:
        return cls(f"owner_reduce: a {cls.__name__} naming its key")
    return maker() if maker is _comm_error else maker(cls)


def round_trip_problems(cls: type[BaseException]) -> list[str]:
    """What is wrong with ``cls`` as a package error: its base, its built-in base, its pickle round trip."""
    problems = []
    if not issubclass(cls, OwnerReduceError):
        problems.append(f"{cls.__name__} does not derive from OwnerReduceError")
    base = BUILT_IN_BASE.get(cls.__name__)
    if base is None:
        problems.append(f"{cls.__name__} has no row in BUILT_IN_BASE")
    elif not issubclass(cls, base):
        problems.append(f"{cls.__name__} lost its base {base.__name__}")
    error = made(cls)
    error.add_note("a note added on the way")
    try:
        back = pickle.loads(pickle.dumps(error))
    except Exception as failure:  # noqa: BLE001 - the failure is the finding
        return [*problems, f"{cls.__name__} does not survive a pickle round trip: {type(failure).__name__}: {failure}"]
    if type(back) is not cls or str(back) != str(error) or back.args != error.args or vars(back) != vars(error):
        problems.append(f"{cls.__name__} came back as {type(back).__name__} {str(back)!r} {vars(back)}, not "
                        f"{str(error)!r} {vars(error)}")
    return problems


def test_the_walk_finds_every_error_class_of_the_package():
    names = {cls.__name__ for cls in error_classes()}
    assert names == set(BUILT_IN_BASE), names ^ set(BUILT_IN_BASE)


@pytest.mark.parametrize("cls", error_classes(), ids=lambda cls: cls.__name__)
def test_every_error_derives_from_the_base_keeps_its_built_in_base_and_survives_pickle(cls):
    assert round_trip_problems(cls) == []


def test_the_comm_errors_fields_come_back():
    error = pickle.loads(pickle.dumps(_comm_error()))
    assert (error.rank, error.dp_rank, error.flush, error.call, error.waited_s) == (3, 1, 7, "reduce_scatter", 20.25)
    assert "rank 3 (data-parallel rank 1), flush #7: reduce_scatter timed out after waiting 20 s" in str(error)
    assert isinstance(error, RuntimeError) and isinstance(error, owner_reduce.OwnerReduceError)


def test_the_errors_are_the_packages_names():
    for cls in error_classes():
        if cls.__module__.startswith(("harness", "owner_reduce.run")):
            continue  # test tooling and the launcher's own command line: not errors a user's code catches
        assert getattr(owner_reduce, cls.__name__) is cls and cls.__name__ in owner_reduce.__all__, cls


class KeywordOnly(RuntimeError):
    """As ``OwnerReduceCommError`` was: unpickling calls ``cls(*args)``, which its keyword-only ``__init__`` refuses."""

    def __init__(self, *, rank: int) -> None:
        super().__init__(f"rank {rank}")
        self.rank = rank


class KeywordOnlyOnTheBase(OwnerReduceError, RuntimeError):
    """The same class on the package's base: it round-trips."""

    def __init__(self, *, rank: int) -> None:
        super().__init__(f"rank {rank}")
        self.rank = rank


def test_negative_control_a_class_without_the_base_or_with_a_keyword_init_is_caught(monkeypatch):
    for cls in (KeywordOnly, KeywordOnlyOnTheBase):
        monkeypatch.setitem(BUILT_IN_BASE, cls.__name__, RuntimeError)
        monkeypatch.setitem(MADE, cls.__name__, lambda cls: cls(rank=2))
    problems = round_trip_problems(KeywordOnly)
    assert any("does not derive from OwnerReduceError" in p for p in problems), problems
    assert any("does not survive a pickle round trip: TypeError" in p for p in problems), problems
    assert round_trip_problems(KeywordOnlyOnTheBase) == []
    monkeypatch.delitem(BUILT_IN_BASE, KeywordOnlyOnTheBase.__name__)
    assert round_trip_problems(KeywordOnlyOnTheBase) == ["KeywordOnlyOnTheBase has no row in BUILT_IN_BASE"]
