"""The installation message about cupy and torch's CUDA (``wiring.cuda_extra``), with faked versions: no GPU, and
no cupy wheel of another CUDA major needs to be installed."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import types
from pathlib import Path

import pytest
import torch

import owner_reduce
from owner_reduce.wiring import cuda_extra, install
from owner_reduce.wiring.cuda_extra import CupyDist, cupy_dists, cupy_problem

CU13_COMMAND = ("pip install 'cupy-cuda13x>=14,<15' 'nvidia-nccl-cu13>=2.27.5,<3' (owner_reduce's cu13 extra: from a "
                "checkout, pip install '.[cu13]')")
CU12_COMMAND = CU13_COMMAND.replace("13", "12")
CU12 = CupyDist("cupy-cuda12x", "14.2.0", 12)
CU13 = CupyDist("cupy-cuda13x", "14.2.0", 13)


@pytest.mark.parametrize(("text", "major"), [("13.0", 13), ("12.8", 12), ("13", 13), (None, None), ("", None)])
def test_cuda_major_of_torch_version_cuda(text, major):
    assert cuda_extra.cuda_major(text) == major


def test_cupy_distributions_are_read_by_name_with_their_cuda_major():
    found = cupy_dists([("numpy", "2.3"), ("CuPy_CUDA13x", "14.1.0"), ("cupy-cuda12x", "14.2.0"), ("cupy", "14.0"),
                        ("cupy-rocm-6-0", "13.6.0"), ("cupyx-extra", "1.0"), ("cupy-cuda12x", "14.2.0")])
    assert found == (CupyDist("cupy", "14.0", None), CU12, CupyDist("cupy-cuda13x", "14.1.0", 13),
                     CupyDist("cupy-rocm-6-0", "13.6.0", None))


def test_installed_cupy_distributions_are_this_interpreters():
    """Against the real metadata: exactly the cupy wheels pip reports here (the suite's venv has one, for its torch)."""
    expected = []
    for name, major in (("cupy-cuda12x", 12), ("cupy-cuda13x", 13)):
        try:
            expected.append(CupyDist(name, importlib.metadata.version(name), major))
        except importlib.metadata.PackageNotFoundError:
            pass
    assert [d for d in cuda_extra.installed_cupy_dists() if d.cuda_major is not None] == expected


@pytest.mark.parametrize("dists", [(), (CU12,), (CU12, CU13)])
def test_a_cpu_torch_gets_no_message(dists):
    assert cupy_problem("2.13.0+cpu", None, dists, cupy_module_found=False) is None


@pytest.mark.parametrize(("torch_version", "cuda", "dists"), [("2.14.1+cu130", "13.0", (CU13,)),
                                                              ("2.13.0+cu128", "12.8", (CU12,)),
                                                              ("2.14.1+cu130", "13.0", (CupyDist("cupy", "14.2.0",
                                                                                                 None),))])
def test_a_matching_or_unknown_cupy_gets_no_message(torch_version, cuda, dists):
    assert cupy_problem(torch_version, cuda, dists, cupy_module_found=True) is None


def test_a_cupy_of_another_cuda_major_names_both_and_the_extra():
    message = cupy_problem("2.14.1+cu130", "13.0", (CU12,), cupy_module_found=True)
    assert message == ("owner_reduce: installation: cupy-cuda12x 14.2.0 is built for CUDA 12, but torch 2.14.1+cu130 "
                       "is a CUDA 13 build: two CUDA runtimes in one process, and cupy NCCL may fail to load (then the "
                       "owner path reduces through torch.distributed (NCCL) instead of cupy NCCL); pip uninstall -y "
                       "cupy-cuda12x && " + CU13_COMMAND)
    assert cupy_problem("2.13.0+cu128", "12.8", (CU13,), True).endswith(CU12_COMMAND)


@pytest.mark.parametrize(("cuda", "extra"), [("13.0", "cu13"), ("12.8", "cu12")])
def test_no_cupy_with_a_cuda_torch_names_the_extra(cuda, extra):
    message = cupy_problem("2.14.1+cuXX", cuda, (), cupy_module_found=False)
    assert message.startswith(f"owner_reduce: installation: torch 2.14.1+cuXX is a CUDA {cuda[:2]} build and no cupy "
                              "is installed, so the owner path reduces through torch.distributed (NCCL)")
    major = extra[2:]
    assert message.endswith(f"for cupy NCCL: pip install 'cupy-cuda{major}x>=14,<15' "
                            f"'nvidia-nccl-cu{major}>=2.27.5,<3' (owner_reduce's {extra} extra: from a checkout, "
                            f"pip install '.[{extra}]')")
    assert "owner_reduce[" not in message  # owner_reduce is not on the package index: a name pip cannot find
    # a cupy module without any distribution (a source tree on the path): its CUDA is unknown, nothing is said
    assert cupy_problem("2.14.1+cuXX", cuda, (), cupy_module_found=True) is None


def test_a_cuda_major_without_an_extra_names_the_cupy_wheel():
    assert cupy_problem("3.0.0+cu140", "14.0", (), False).endswith("for cupy NCCL: pip install cupy-cuda14x")


def test_two_cupy_distributions_are_named_as_broken():
    message = cupy_problem("2.14.1+cu130", "13.0", (CU12, CU13), cupy_module_found=True)
    assert message == ("owner_reduce: installation: 2 cupy distributions are installed at once (cupy-cuda12x 14.2.0, "
                       "cupy-cuda13x 14.2.0): they write the same 'cupy' package over each other, so neither is intact "
                       "(cupy may fail to import, or load libraries of both); torch 2.14.1+cu130 is a CUDA 13 build: "
                       "pip uninstall -y cupy-cuda12x cupy-cuda13x && " + CU13_COMMAND)


# ---- at install(): DeepSpeed's logger, faked versions ---------------------------------------------------------------


class _Logged:
    """DeepSpeed's logger does not propagate to the root logger: listen on it directly."""

    def __init__(self) -> None:
        from deepspeed.utils import logger

        self.lines: list[str] = []
        self._logger = logger
        self._handler = logging.Handler(level=logging.WARNING)
        self._handler.emit = lambda record: self.lines.append(record.getMessage())
        logger.addHandler(self._handler)

    def close(self) -> list[str]:
        self._logger.removeHandler(self._handler)
        return [line for line in self.lines if line.startswith("owner_reduce: installation")]


def _fake_environment(monkeypatch, version: str, cuda: str | None, dists: list[tuple[str, str]]) -> None:
    """torch's version and CUDA, and the installed distributions (as ``importlib.metadata`` returns them)."""
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    fakes = [types.SimpleNamespace(metadata={"Name": name}, version=v) for name, v in [("numpy", "2.3"), *dists]]
    monkeypatch.setattr(cuda_extra, "_distributions", lambda: iter(fakes))


@pytest.fixture
def fresh_install():
    assert not owner_reduce.is_installed()
    yield
    owner_reduce.uninstall()


@pytest.mark.parametrize(("dists", "expected"), [
    ([("cupy-cuda12x", "14.2.0")], "cupy-cuda12x 14.2.0 is built for CUDA 12, but torch 2.14.1+cu130 is a CUDA 13"),
    ([("cupy-cuda12x", "14.2.0"), ("cupy-cuda13x", "14.2.0")], "2 cupy distributions are installed at once"),
])
def test_install_warns_through_deepspeeds_logger(monkeypatch, fresh_install, dists, expected):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    _fake_environment(monkeypatch, "2.14.1+cu130", "13.0", dists)
    logged = _Logged()
    owner_reduce.install()
    owner_reduce.install()  # idempotent: nothing new is installed, nothing is said again
    lines = logged.close()
    assert len(lines) == 1 and expected in lines[0] and lines[0].endswith(CU13_COMMAND)


def test_install_with_a_matching_cupy_says_nothing(monkeypatch, fresh_install):
    _fake_environment(monkeypatch, "2.14.1+cu130", "13.0", [("cupy-cuda13x", "14.2.0")])
    logged = _Logged()
    owner_reduce.install()
    assert logged.close() == []


def test_the_message_is_logged_once_per_node_and_returned_on_every_rank(monkeypatch):
    _fake_environment(monkeypatch, "2.14.1+cu130", "13.0", [])
    monkeypatch.setattr(cuda_extra, "_cupy_module_found", lambda: False)
    logged = _Logged()
    other = install.warn_about_cupy({"LOCAL_RANK": "3"})
    first = install.warn_about_cupy({"LOCAL_RANK": "0"})
    assert other == first and "no cupy is installed" in first
    assert logged.close() == [first]


def test_a_failing_check_is_a_message_not_an_install_failure(monkeypatch):
    def broken():
        raise RuntimeError("metadata unreadable")

    monkeypatch.setattr(cuda_extra, "installed_cupy_dists", broken)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert install.warn_about_cupy({}) == ("owner_reduce: installation: could not compare cupy with torch's CUDA "
                                           "(RuntimeError: metadata unreadable)")


def test_pyproject_brings_cupy_only_through_one_extra_per_cuda_major():
    """The base install has no cupy and no NCCL wheel (CPU and torch.distributed need neither); each CUDA extra brings
    the one cupy and NCCL of its major, and the extras are the ones the message names."""
    tomllib = pytest.importorskip("tomllib")  # python >= 3.11
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}

    assert not {n for n in names(project["dependencies"]) if n.startswith(("cupy", "nvidia-nccl"))}
    extras = project["optional-dependencies"]
    for major, extra in cuda_extra.EXTRAS.items():
        assert names(extras[extra]) == {f"cupy-cuda{major}x", f"nvidia-nccl-cu{major}"}
        assert tuple(extras[extra]) == cuda_extra.EXTRA_PACKAGES[major]  # the message's command installs the extra
    for name, requirements in extras.items():
        if name not in cuda_extra.EXTRAS.values():
            assert not {n for n in names(requirements) if n.startswith(("cupy", "nvidia-nccl"))}, name


def test_describe_names_torchs_cuda_the_extra_the_cupy_and_a_problem():
    assert cuda_extra.describe("2.14.1+cu130", "13.0", (CU13,), True) == (
        "CUDA extra: torch 2.14.1+cu130 is a CUDA 13 build: " + CU13_COMMAND + "; cupy installed: "
        "cupy-cuda13x 14.2.0")
    assert cuda_extra.describe("2.13.0+cpu", None, (CU12,), True) == (
        "CUDA extra: torch 2.13.0+cpu is not a CUDA build: no cupy NCCL; cupy installed: cupy-cuda12x 14.2.0")
    mismatch = cuda_extra.describe("2.14.1+cu130", "13.0", (CU12,), True)
    assert mismatch.endswith("; PROBLEM: " + cupy_problem("2.14.1+cu130", "13.0", (CU12,), True))
    assert "cupy installed: none; PROBLEM: " in cuda_extra.describe("2.14.1+cu130", "13.0", (), False)


# ---- the ranges of torch, DeepSpeed and NCCL: what ran, vendor builds kept, torch's own NCCL pin admitted -----------

def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # python >= 3.11
    return tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]


def _requirement(requirements: list[str], name: str):
    from packaging.requirements import Requirement

    (found,) = [r for r in map(Requirement, requirements) if r.name == name]
    return found.specifier


def _pip_keeps(specifier, installed: str) -> bool:
    """Whether pip keeps an installed version for this requirement: it asks ``contains(version, prereleases=True)``
    (pip's resolver, ``factory._get_installed_candidate``), so only the range itself decides."""
    return specifier.contains(installed, prereleases=True)


VENDOR = "2.13.0a0+50eac811a6.nv25.09"  # the form of an NGC or source build: a pre-release with a local label


def test_torch_and_deepspeed_ranges_are_what_the_suite_ran_and_keep_vendor_builds_of_them():
    torch_range = _requirement(_pyproject()["dependencies"], "torch")
    for version in ("2.13.0", "2.13.0+cpu", "2.14.1+cu130", "2.15.0", VENDOR, "2.15.0a0+git5c48869"):
        assert _pip_keeps(torch_range, version), version
    for version in ("2.12.1", "2.9.0a0+50eac811a6.nv25.09", "2.16.0", "2.16.0a0+git5c48869", "2.13.0.dev20260101"):
        assert not _pip_keeps(torch_range, version), version  # never ran: pip may replace it (or --no-deps keeps it)
    deepspeed_range = _requirement(_pyproject()["dependencies"], "deepspeed")
    assert _pip_keeps(deepspeed_range, "0.19.8") and not _pip_keeps(deepspeed_range, "0.19.9")


def test_negative_control_the_plain_spelling_makes_pip_replace_a_vendor_build():
    """What ">=2.13.0a0" is for: the same range spelled ">=2.13" refuses the vendor build of 2.13."""
    from packaging.specifiers import SpecifierSet

    assert not _pip_keeps(SpecifierSet(">=2.13,<2.16"), VENDOR)
    assert _pip_keeps(SpecifierSet(">=2.13.0a0,<2.16"), VENDOR)


def test_each_extras_nccl_admits_the_nccl_torchs_own_wheel_pins():
    """torch 2.14.1+cu130 (PyPI's wheel) requires nvidia-nccl-cu13==2.30.7: the extra must admit it, or pip would
    have to move torch or NCCL; a pin of another version (the GPU check's 2.32.3) would not."""
    from packaging.specifiers import SpecifierSet

    extras = _pyproject()["optional-dependencies"]
    cu13 = _requirement(extras["cu13"], "nvidia-nccl-cu13")
    cu12 = _requirement(extras["cu12"], "nvidia-nccl-cu12")
    assert _pip_keeps(cu13, "2.30.7") and _pip_keeps(cu12, "2.27.5") and _pip_keeps(cu12, "2.32.3")
    assert not _pip_keeps(cu13, "3.0.0") and not _pip_keeps(SpecifierSet("==2.32.3"), "2.30.7")


def test_a_torch_or_deepspeed_outside_the_ranges_is_named_once_at_install():
    requires = ["torch>=2.13.0a0,<2.16", "deepspeed>=0.19.8,<0.19.9", "numpy", 'nvidia-nccl-cu12<3; extra == "cu12"']
    assert cuda_extra.version_problems(requires, {"torch": VENDOR, "deepspeed": "0.19.8", "numpy": "1.0"}) == []
    (torch_line, ds_line) = cuda_extra.version_problems(requires, {"torch": "2.12.1+cu126", "deepspeed": "0.19.9"})
    assert torch_line == ("owner_reduce: installation: torch 2.12.1+cu126 is outside the versions owner_reduce's "
                          "tests ran (torch<2.16,>=2.13.0a0); it may work, untested")
    assert ds_line.startswith("owner_reduce: installation: deepspeed 0.19.9 is outside")
    assert cuda_extra.environment_version_problems() == []  # this venv: pip's own ranges


def _hand_made_wheel(folder: Path, name: str, requirement: str) -> Path:
    """A wheel whose only content is its metadata: ``Requires-Dist: requirement``."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-0.1.dist-info"
    files = {f"{name}/__init__.py": b"",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\nRequires-Dist: {requirement}\n"
             .encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    path = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        record = []
        for member, data in files.items():
            wheel.writestr(member, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{member},sha256={digest},{len(data)}")
        wheel.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return path


@pytest.mark.timeout(120)
def test_pip_itself_keeps_a_vendor_torch_for_the_range_and_not_for_the_plain_spelling(tmp_path):
    """pip's own resolver (``pip --python VENV install --dry-run --no-index --isolated``) in a venv whose torch is a
    vendor build: the project's torch range is satisfied by it; the control, ">=2.13,<2.16", sends pip looking for
    another torch (none is offered here, so it fails naming torch)."""
    import subprocess
    import sys
    import venv

    venv.EnvBuilder(with_pip=False).create(tmp_path / "v")
    python = tmp_path / "v" / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    torch_info = Path(site) / f"torch-{VENDOR}.dist-info"
    torch_info.mkdir(parents=True)
    (torch_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {VENDOR}\n")
    (torch_info / "RECORD").write_text("")
    spelled = str(_requirement(_pyproject()["dependencies"], "torch"))

    # pip reads no configuration, constraint or index here: only what is installed in the venv can satisfy torch
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, "PIP_CONFIG_FILE": os.devnull}

    def dry_run(name: str, requirement: str) -> str:
        wheel = _hand_made_wheel(tmp_path, name, f"torch{requirement}")
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run",
                               "--no-index", str(wheel)], capture_output=True, text=True, timeout=90, env=env)
        return f"rc={done.returncode}\n{done.stdout}{done.stderr}"

    kept = dry_run("probe_range", spelled)
    assert kept.startswith("rc=0") and f"Requirement already satisfied: torch{spelled}" in kept, kept
    replaced = dry_run("probe_plain", ">=2.13,<2.16")
    assert not replaced.startswith("rc=0") and "Requirement already satisfied: torch" not in replaced, replaced
    assert "ERROR: Could not find a version that satisfies the requirement torch" in replaced, replaced
