"""Whether this environment's cupy fits torch's CUDA: the one installation message ``install()`` logs.

Why a message at all: cupy and NCCL come from an extra chosen by the CUDA major version (``owner_reduce[cu12]``:
cupy-cuda12x + nvidia-nccl-cu12; ``owner_reduce[cu13]``: cupy-cuda13x + nvidia-nccl-cu13), and the base install
has neither. Without a matching cupy the owner path still runs and gives the same sums, through torch.distributed
(``runtime.comm_select`` falls back, with its own warning at ``engine.compile()``); so this is a warning that names
the extra to add, not an error, and it comes at ``install()``, before anything is built.

Why package metadata, not ``import cupy``: the question is about what is installed, and metadata answers it with
no GPU, no CUDA library loaded and no cupy import (which stays in ``runtime.nccl_binding``). Each cupy wheel names its
CUDA major (``cupy-cuda12x``, ``cupy-cuda13x``); a source build (``cupy``) or a ROCm one does not, and then
nothing is said. Two cupy wheels at once write the same ``cupy`` package over each other: neither is intact.
torch's own CUDA major is ``torch.version.cuda`` (``"13.0"`` in ``2.14.1+cu130``; None in a CPU or ROCm build,
which never takes the cupy NCCL path, so nothing is said there either).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PREFIX = "owner_reduce: installation"
EXTRAS = {12: "cu12", 13: "cu13"}  # CUDA major -> the extra in pyproject.toml that brings cupy and NCCL for it
# The extras' packages, exactly as pyproject.toml lists them (a test compares): owner_reduce is not on the package
# index, so "pip install 'owner_reduce[cu13]'" installs nothing; these names are what a user can run.
EXTRA_PACKAGES = {12: ("cupy-cuda12x>=14,<15", "nvidia-nccl-cu12>=2.27.5,<3"),
                  13: ("cupy-cuda13x>=14,<15", "nvidia-nccl-cu13>=2.27.5,<3")}
CHECKED_VERSIONS = ("torch", "deepspeed")  # whose installed version install() compares with the package's ranges
_CUPY_NAME = re.compile(r"^cupy(?:-cuda(?P<major>\d+)x|-rocm-[\w-]+)?$")
_distributions = importlib.metadata.distributions  # this module's own name for it: tests replace it here only


@dataclass(frozen=True)
class CupyDist:
    """One installed cupy distribution: its name, version and the CUDA major its wheel was built for (or None)."""

    name: str
    version: str
    cuda_major: int | None


def cuda_major(version_cuda: str | None) -> int | None:
    """The major of ``torch.version.cuda`` (``"13.0"`` -> 13); None for a CPU or ROCm build."""
    if not version_cuda:
        return None
    head = version_cuda.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def cupy_dists(names_and_versions: Iterable[tuple[str, str]]) -> tuple[CupyDist, ...]:
    """The cupy distributions among ``(name, version)`` pairs, each name once, sorted by name."""
    found: dict[str, CupyDist] = {}
    for raw_name, version in names_and_versions:
        name = re.sub(r"[-_.]+", "-", raw_name).lower()
        match = _CUPY_NAME.match(name)
        if match and name not in found:
            major = match.group("major")
            found[name] = CupyDist(name, version, int(major) if major else None)
    return tuple(sorted(found.values(), key=lambda d: d.name))


def installed_cupy_dists() -> tuple[CupyDist, ...]:
    """The cupy distributions this interpreter has installed (package metadata; nothing is imported)."""
    return cupy_dists((d.metadata["Name"] or "", d.version) for d in _distributions())


def extra_for(major: int) -> str:
    """How to install cupy and NCCL for CUDA ``major``, as a command a user can run: the extra's packages (and how to
    get them with owner_reduce from a checkout or a wheel), or the cupy wheel where no extra exists."""
    packages = EXTRA_PACKAGES.get(major)
    if packages is None:
        return f"pip install cupy-cuda{major}x"
    named = " ".join(f"'{p}'" if any(c in p for c in "<>=") else p for p in packages)
    return (f"pip install {named} (owner_reduce's {EXTRAS[major]} extra: from a checkout, "
            f"pip install '.[{EXTRAS[major]}]')")


def _named(dists: Sequence[CupyDist]) -> str:
    return ", ".join(f"{d.name} {d.version}" for d in dists)


def cupy_problem(torch_version: str, torch_cuda: str | None, dists: Sequence[CupyDist],
                 cupy_module_found: bool) -> str | None:
    """The message for this environment, or None when cupy fits torch's CUDA (or there is nothing to tell).

    ``cupy_module_found``: a ``cupy`` module is importable without any cupy distribution (a source tree on the
    path): its CUDA is unknown, so nothing is said.
    """
    major = cuda_major(torch_cuda)
    if major is None:
        return None
    torch_words = f"torch {torch_version} is a CUDA {major} build"
    fallback = "the owner path reduces through torch.distributed (NCCL) instead of cupy NCCL"
    if len(dists) > 1:
        uninstall = " ".join(d.name for d in dists)
        return (f"{PREFIX}: {len(dists)} cupy distributions are installed at once ({_named(dists)}): they write the "
                f"same 'cupy' package over each other, so neither is intact (cupy may fail to import, or load "
                f"libraries of both); {torch_words}: pip uninstall -y {uninstall} && {extra_for(major)}")
    if not dists:
        if cupy_module_found:
            return None
        return (f"{PREFIX}: {torch_words} and no cupy is installed, so {fallback}; for cupy NCCL: "
                f"{extra_for(major)}")
    dist = dists[0]
    if dist.cuda_major is None or dist.cuda_major == major:
        return None
    return (f"{PREFIX}: {dist.name} {dist.version} is built for CUDA {dist.cuda_major}, but {torch_words}: two "
            f"CUDA runtimes in one process, and cupy NCCL may fail to load (then {fallback}); "
            f"pip uninstall -y {dist.name} && {extra_for(major)}")


def version_problems(requirements: Iterable[str], installed: dict[str, str]) -> list[str]:
    """One message per package of ``CHECKED_VERSIONS`` whose installed version lies outside owner_reduce's own
    requirement (its metadata's ``Requires-Dist``), judged as pip judges an installed version (pre-releases admitted
    by the range itself: a vendor build ``2.13.0a0+...`` fits ``>=2.13.0a0``). Why: ``pip install --no-deps`` keeps a
    user's stack, and then nothing but this says that the versions were never run together."""
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion

    problems = []
    for text in requirements:
        requirement = Requirement(text)
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if name not in CHECKED_VERSIONS or requirement.marker is not None or name not in installed:
            continue
        try:
            fits = requirement.specifier.contains(installed[name], prereleases=True)
        except InvalidVersion:
            fits = False
        if not fits:
            problems.append(f"{PREFIX}: {name} {installed[name]} is outside the versions owner_reduce's tests ran "
                            f"({name}{requirement.specifier}); it may work, untested")
    return problems


def environment_version_problems() -> list[str]:
    """``version_problems`` for this interpreter; none where owner_reduce has no package metadata (a source tree)."""
    try:
        requirements = importlib.metadata.requires("owner_reduce") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    installed = {}
    for name in CHECKED_VERSIONS:
        try:
            installed[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return version_problems(requirements, installed)


def describe(torch_version: str, torch_cuda: str | None, dists: Sequence[CupyDist], cupy_module_found: bool) -> str:
    """One line for tools (``scripts/gpu_plan.py``): torch's CUDA, the extra that fits it, the cupy installed, and
    the installation message if there is one."""
    major = cuda_major(torch_cuda)
    fits = (f"torch {torch_version} is a CUDA {major} build: {extra_for(major)}" if major is not None
            else f"torch {torch_version} is not a CUDA build: no cupy NCCL")
    have = _named(dists) or ("a cupy module without package metadata" if cupy_module_found else "none")
    problem = cupy_problem(torch_version, torch_cuda, dists, cupy_module_found)
    return f"CUDA extra: {fits}; cupy installed: {have}" + (f"; PROBLEM: {problem}" if problem else "")


def _cupy_module_found() -> bool:
    """Whether a ``cupy`` module is on the path (found, not imported)."""
    return importlib.util.find_spec("cupy") is not None


def _environment() -> tuple[str, str | None, tuple[CupyDist, ...], bool]:
    import torch

    return torch.__version__, torch.version.cuda, installed_cupy_dists(), _cupy_module_found()


def environment_problem() -> str | None:
    """``cupy_problem`` for this interpreter: torch's version and CUDA, and the installed cupy distributions."""
    return cupy_problem(*_environment())


def describe_environment() -> str:
    """``describe`` for this interpreter."""
    return describe(*_environment())
