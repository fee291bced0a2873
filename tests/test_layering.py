"""The package's folders are its layers: this reads every module's imports (lazy ones too) and refuses a
product module that imports the harness, a pure planning module that reaches torch.distributed, deepspeed,
cupy or another layer, and cupy anywhere but the one communicator module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "owner_reduce"
CUPY_HOME = "owner_reduce.runtime.nccl_comm"
PLANNING_FORBIDDEN = ("torch.distributed", "deepspeed", "cupy")
NESTED = "owner_reduce.planning.algorithms"  # the one package two folders deep


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module a source imports, at top level or inside a function, relative imports made absolute
    (``from x import y`` also counts ``x.y``, which may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layering_problems(module: str, imported: set[str]) -> list[str]:
    problems = []
    product = not _within(module, "owner_reduce.harness")
    if product:
        problems += [f"{module} (product) imports the harness: {n}" for n in sorted(imported)
                     if _within(n, "owner_reduce.harness")]
    if _within(module, "owner_reduce.planning"):
        problems += [f"{module} (pure planning) imports {n}" for n in sorted(imported)
                     if any(_within(n, f) for f in PLANNING_FORBIDDEN)
                     or (_within(n, "owner_reduce") and n != "owner_reduce"
                         and not _within(n, "owner_reduce.planning"))]
    if module != CUPY_HOME:
        problems += [f"{module} imports cupy (only {CUPY_HOME} may)" for n in sorted(imported) if _within(n, "cupy")]
    return problems


def all_modules() -> list[tuple[str, set[str]]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        out.append((name, imports_of(path.read_text(), name, path.name == "__init__.py")))
    return out


def test_every_layer_has_its_folder() -> None:
    names = {name for name, _ in all_modules()}
    for layer in ("planning", "wiring", "runtime", "offline_sizing", "harness"):
        assert f"owner_reduce.{layer}" in names
    # Modules live one folder deep; the flush algorithms are one package inside planning (its registry and one module
    # per algorithm: ``planning.algorithms``), and still pure planning.
    deep = {n for n in names if n.count(".") > 2}
    assert {n for n in deep if not _within(n, NESTED)} == set(), "modules live one folder deep"
    assert {n.count(".") for n in deep} <= {3}


def test_the_layers_keep_their_imports() -> None:
    problems = [p for name, imported in all_modules() for p in layering_problems(name, imported)]
    assert problems == []


def test_the_import_reader_sees_what_it_must() -> None:
    # The reader itself: relative, absolute and lazy (inside a function) imports all resolve.
    src = "from ..harness.launch import run_ranks\nimport torch\n\ndef f():\n    from ..planning import probe\n"
    found = imports_of(src, "owner_reduce.runtime.handle")
    assert {"owner_reduce.harness.launch", "owner_reduce.planning.probe", "torch"} <= found
    assert "owner_reduce.wiring.ops" in imports_of("from .ops import x", "owner_reduce.wiring", is_package=True)


@pytest.mark.parametrize(("module", "source"), [
    ("owner_reduce.runtime.handle", "def f():\n    from ..harness.faults import inject\n"),
    ("owner_reduce.wiring.activation", "import owner_reduce.harness.launch\n"),
    ("owner_reduce.planning.flush_plan", "import torch.distributed as dist\n"),
    ("owner_reduce.planning.owner_map", "from deepspeed.utils import logger\n"),
    ("owner_reduce.planning.probe", "from ..runtime.comm import ReduceComm\n"),
    ("owner_reduce.runtime.comm", "import cupy\n"),
])
def test_negative_control_a_broken_layering_is_refused(module: str, source: str) -> None:
    assert layering_problems(module, imports_of(source, module)), f"{module} with {source!r} passed"


THREAD_HOME = "owner_reduce.runtime.threads"


def thread_starts(source: str) -> list[int]:
    """The lines of every ``threading.Thread(...)`` or bare ``Thread(...)`` call in ``source``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name == "Thread":
                lines.append(node.lineno)
    return lines


def test_every_product_thread_starts_on_the_ranks_device() -> None:
    """Issue 46, finding 1: a thread that never set its CUDA device makes a context on GPU 0, so the product's threads
    are started by ``runtime.threads`` alone, which sets the rank's device first (the harness is not the product)."""
    starts = [f"{module_name(path)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
              if module_name(path) != THREAD_HOME and not _within(module_name(path), "owner_reduce.harness")
              for line in thread_starts(path.read_text())]
    assert starts == [], f"threads started outside {THREAD_HOME}: {starts}"


def test_negative_control_a_bare_thread_is_seen() -> None:
    assert thread_starts("import threading\nt = threading.Thread(target=print)\n") == [2]
    assert thread_starts("from threading import Thread\n\ndef f():\n    Thread(target=f).start()\n") == [4]
