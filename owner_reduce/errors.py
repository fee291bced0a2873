"""Every error owner_reduce raises derives from ``OwnerReduceError``; all but the flush deadline's live here.

Why one base: a launcher, a trainer or a test catches owner_reduce's refusals and failures with one ``except`` and
tells them from its own; each class also keeps the built-in base it had (``ValueError`` for a bad value,
``RuntimeError`` for a refusal at run time), so an ``except`` written against those still catches it.
Why a module of its own, importing nothing: ``import owner_reduce`` exports the errors without importing torch or
DeepSpeed, and every layer (pure planning too) may raise them.

Note (errors cross processes): a launcher that reports a child rank's failure pickles the exception; Python rebuilds
an exception by calling its class with ``args``, which fails for a class whose ``__init__`` takes other arguments
(``runtime.deadline.OwnerReduceCommError`` takes keywords only: ``TypeError`` on unpickling). ``OwnerReduceError``
rebuilds every subclass from its message and fields instead, without calling ``__init__``
(``tests/repo/test_errors.py`` round-trips every error class of the package).
"""

from __future__ import annotations

from typing import Any


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...]) -> BaseException:
    """An error of ``cls`` with ``args``, ``__init__`` not called (pickle then restores its fields)."""
    error = cls.__new__(cls, *args)
    error.args = args
    return error


class OwnerReduceError(Exception):
    """The base of every owner_reduce error; the message names the key, value, rank or call."""

    def __reduce__(self) -> tuple[Any, ...]:
        # (rebuild, its arguments, the fields: ``__dict__``, which BaseException.__setstate__ restores; add_note's
        # notes are among them)
        return _rebuilt, (type(self), self.args), self.__dict__ or None


class OwnerReduceConfigError(OwnerReduceError, ValueError):
    """A DeepSpeed config value owner_reduce cannot accept; the message names the key (``planning.settings``)."""


class OwnerMapError(OwnerReduceError, ValueError):
    """The partition tables contradict themselves; the message names the group and parameter
    (``planning.owner_map``)."""


class OwnerReduceMismatchError(OwnerReduceError, RuntimeError):
    """Ranks disagree on a setting, the bucket size or the owner map, or a rank cannot use what its config names;
    raised on every rank before any training collective. ``fields``: the init-time agreement's fields that differ
    across ranks (``runtime.agreement``), empty where the refusal is another one."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = tuple(fields)


class OwnerReduceInstallError(OwnerReduceError, RuntimeError):
    """DeepSpeed's private surface moved; the message names what is missing (``wiring.install``)."""


class OwnerReduceInUseError(OwnerReduceError, RuntimeError):
    """``uninstall()`` while an engine compiled with the flags is live: it would break that engine
    (``wiring.install``)."""


class UnknownCallKindError(OwnerReduceError, LookupError):
    """A site met a call kind its table lacks (``planning.calls`` Note (no fall-through)): a code change added a kind
    and missed a site. ``kind`` is what it met (a ``CallKind``, a (level, kind) pair, or a string no member spells),
    ``site`` the table's owner."""

    def __init__(self, kind: Any, site: str) -> None:
        super().__init__(kind, site)
        self.kind = kind
        self.site = site

    def __str__(self) -> str:
        return (f"owner_reduce: {self.site} has no entry for the call kind {self.kind!r}: every site that maps call "
                f"kinds names each one it handles (owner_reduce.planning.calls Note (no fall-through))")


class UnknownAlgorithmError(OwnerReduceError, LookupError):
    """No flush algorithm of that name is registered (``planning.algorithms``)."""

    def __init__(self, name: str, known: tuple[str, ...]) -> None:
        super().__init__(name, known)
        self.name = name
        self.known = known

    def __str__(self) -> str:
        return f"owner_reduce: no flush algorithm {self.name!r} is registered (registered: {', '.join(self.known)})"


class UnknownStepError(OwnerReduceError, TypeError):
    """A flush's program holds a step the executor has no entry for (``runtime.executor``): a code change added a
    step and missed the executor."""

    def __init__(self, step: Any, known: tuple[str, ...]) -> None:
        super().__init__(step, known)
        self.step = step
        self.known = known

    def __str__(self) -> str:
        return (f"owner_reduce: the flush executor has no entry for the step {type(self.step).__name__} "
                f"({self.step!r}); it runs {', '.join(self.known)}")


__all__ = ["OwnerMapError", "OwnerReduceConfigError", "OwnerReduceError", "OwnerReduceInUseError",
           "OwnerReduceInstallError", "OwnerReduceMismatchError", "UnknownAlgorithmError", "UnknownCallKindError",
           "UnknownStepError"]
