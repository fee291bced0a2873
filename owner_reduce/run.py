"""``python -m owner_reduce.run [--accelerate-backend NAME] SCRIPT|-m MODULE [ARGS...]``: install, run the script.

Why: a job whose training script cannot be edited (a framework's entry point, a cluster template, DeepSpeed's own
benchmarks) has no place to call ``owner_reduce.install()``, and without it DeepSpeed rejects the two config keys.
This module installs the plug-in and then runs the script or module as ``__main__`` in this same process, with the
arguments it would have had, so it goes wherever a launcher accepts a module:
``torchrun ... -m owner_reduce.run train.py ...``, ``deepspeed --module owner_reduce.run train.py ...``,
``accelerate launch -m owner_reduce.run train.py ...``, ``python -m owner_reduce.run train.py ...``.

Note (one process): the user's code runs in this interpreter through ``runpy``, not in a child: a launcher's signal
reaches it directly, its handlers are its own (nothing here installs one), and its exit code or uncaught exception
is the process's. ``sys.argv`` is what ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would give, and for a
script ``sys.path[0]`` is the script's folder, as Python sets it. A script that calls ``install()`` itself is fine:
install() is idempotent.

Note (--local_rank): DeepSpeed's launcher with ``--module`` starts ``python -u -m owner_reduce.run --local_rank=N
train.py ...`` (it puts ``--local_rank=N`` right after the module, unless ``--no_local_rank``), and
``torch.distributed.launch`` puts ``--local-rank=N`` there. Such an argument, found before the script, is handed to
the script right after its name, where it would be had the launcher started the script itself.

Note (--accelerate-backend): accelerate's ``PartialState`` picks no process-group backend on a machine without an
accelerator, so under DeepSpeed it lets DeepSpeed initialize the world (ws ranks) yet counts one process itself, and
DeepSpeed then refuses the batch sizes accelerate fills in. ``--accelerate-backend gloo`` creates a DeepSpeed
``PartialState(backend="gloo")`` before the script runs; the script's ``Accelerator`` shares that state, and so
does the transformers Trainer when told
``--accelerator_config '{"use_configured_state": true}'`` (with DeepSpeed it passes accelerate no backend of its
own). For CPU runs; with CUDA accelerate picks nccl itself.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import runpy
import sys
from collections.abc import Sequence

from .errors import OwnerReduceError

USAGE = """\
usage: python -m owner_reduce.run [--accelerate-backend NAME] SCRIPT [ARGS...]
       python -m owner_reduce.run [--accelerate-backend NAME] -m MODULE [ARGS...]

Runs owner_reduce.install(), then SCRIPT (or MODULE) as __main__ with ARGS, in this process.
Launchers: torchrun ... -m owner_reduce.run train.py ARGS; deepspeed ... --module owner_reduce.run train.py ARGS;
accelerate launch ... -m owner_reduce.run train.py ARGS. A --local_rank=N (or --local-rank=N) that a launcher
puts before SCRIPT is handed to SCRIPT right after its name.
  --accelerate-backend NAME   create accelerate's PartialState(backend=NAME) first (gloo: accelerate with
                              DeepSpeed on a machine without a GPU)"""

_LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")


class UsageError(OwnerReduceError, ValueError):
    """The command line names no script or module, or an option this module does not know (empty: -h)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """What to run: a script path or a module name, and the ``sys.argv`` it sees (its name first)."""

    module: bool
    name: str
    argv: tuple[str, ...]
    accelerate_backend: str | None = None


def parse(argv: Sequence[str]) -> Target:
    """The target of ``python -m owner_reduce.run ARGV``; everything from the script (or module) on is the user's."""
    args = list(argv)
    launcher_args: list[str] = []  # --local_rank=N put in front by a launcher, for the script
    backend = None
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, value = arg.partition("=")
        if flag in _LOCAL_RANK_FLAGS:
            if eq:
                launcher_args.append(arg)
            elif i + 1 < len(args):
                launcher_args += args[i:i + 2]
                i += 1
            else:
                raise UsageError(f"{arg} needs a value")
        elif flag == "--accelerate-backend":
            if not eq:
                if i + 1 >= len(args):
                    raise UsageError("--accelerate-backend needs a value (e.g. gloo)")
                i += 1
                value = args[i]
            if not value:
                raise UsageError("--accelerate-backend needs a value (e.g. gloo)")
            backend = value
        elif arg in ("-h", "--help"):
            raise UsageError("")
        elif arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")):
            name = arg[2:] or (args[i + 1] if i + 1 < len(args) else "")
            if not name:
                raise UsageError("-m needs a module name")
            rest = args[i + 1:] if arg != "-m" else args[i + 2:]
            return Target(True, name, (name, *launcher_args, *rest), backend)
        elif arg.startswith("-"):
            raise UsageError(f"unknown option {arg!r} before the script (options after it go to the script)")
        else:
            return Target(False, arg, (arg, *launcher_args, *args[i + 1:]), backend)
        i += 1
    raise UsageError("no script or -m module to run")


def _check_exists(target: Target) -> None:
    """Refuse a missing script or module before install() imports DeepSpeed (as ``python`` itself would)."""
    if target.module:
        try:
            found = importlib.util.find_spec(target.name) is not None
        except ImportError:  # a missing parent package
            found = False
        if not found:
            raise UsageError(f"No module named {target.name!r}")
    elif not os.path.isfile(target.name):
        raise UsageError(f"can't open file {target.name!r}: no such file")


def _create_accelerate_state(backend: str) -> None:
    """accelerate's PartialState for DeepSpeed over ``backend``: ``ACCELERATE_USE_DEEPSPEED`` is set while it is
    created where no launcher set it (torchrun), as transformers' TrainingArguments does for its own state."""
    from accelerate import PartialState

    key = "ACCELERATE_USE_DEEPSPEED"
    set_here = key not in os.environ
    if set_here:
        os.environ[key] = "true"
    try:
        PartialState(backend=backend)
    finally:
        if set_here:
            del os.environ[key]


def run(target: Target) -> None:
    """Install owner_reduce, then run ``target`` as ``__main__``; its SystemExit and exceptions pass through."""
    from .wiring.install import install

    install()
    if target.accelerate_backend is not None:
        _create_accelerate_state(target.accelerate_backend)
    sys.argv[:] = target.argv
    if target.module:
        runpy.run_module(target.name, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target.name))
        runpy.run_path(target.name, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: usage errors exit 2 before anything is installed; then whatever the user's code does."""
    try:
        target = parse(sys.argv[1:] if argv is None else argv)
        _check_exists(target)
    except UsageError as e:
        if not str(e):  # -h / --help
            print(USAGE)
            raise SystemExit(0) from None
        print(f"owner_reduce.run: {e}\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2) from None
    run(target)


if __name__ == "__main__":
    main()
