"""The package's folders are its layers: this reads every module's imports (lazy ones too) and refuses a
product module that imports the tooling beside it (harness/, research/, tests/, scripts/), a pure planning module
that reaches torch.distributed, deepspeed, cupy or another layer, cupy anywhere but cupy's binding
(``runtime.nccl_binding``), a thread started anywhere but ``runtime.threads``, an import cycle among the package's
modules, and a module that uses another module's private name (the tests are not the package: they may reach into
it). The tooling is not packaged either: pyproject's package search finds none of it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "owner_reduce"
CUPY_HOME = "owner_reduce.runtime.nccl_binding"
PLANNING_FORBIDDEN = ("torch.distributed", "deepspeed", "cupy")
PURE_SHARED = ("owner_reduce.errors",)  # imports nothing: every layer may raise the package's errors
NESTED = "owner_reduce.planning.algorithms"  # the one package two folders deep
# Beside the package in the checkout, never packaged, never imported by the product (not even inside a function): the
# rank launcher, toy training and faults; the research on the cost model; the tests; the scripts.
TOOLING = ("harness", "research", "tests", "scripts")


def tooling_names() -> frozenset[str]:
    """Every top-level name the tooling can be imported by: its folders, and each module and folder inside tests/ and
    scripts/, which pytest's path handling and ``python scripts/x.py`` make importable by their bare names (``fakes``,
    ``sim_cuda``, ``gpu_e2e``)."""
    names = set(TOOLING)
    for folder in ("tests", "scripts"):
        names.update(path.stem for path in (ROOT / folder).rglob("*")
                     if "__pycache__" not in path.parts and (path.suffix == ".py" or path.is_dir()))
    return frozenset(names)


TOOLING_NAMES = tooling_names()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module a source imports, at top level or inside a function, relative imports made absolute
    (``from x import y`` also counts ``x.y``, which may be a submodule)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = import_target(node, module, is_package)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def import_target(node: ast.ImportFrom, module: str, is_package: bool = False) -> str:
    """The module a ``from ... import`` in ``module`` reads from, a relative one made absolute."""
    if not node.level:
        return node.module or ""
    base = (module if is_package else module.rpartition(".")[0]).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layering_problems(module: str, imported: set[str]) -> list[str]:
    problems = [f"{module} (product) imports tooling: {n}" for n in sorted(imported)
                if n.partition(".")[0] in TOOLING_NAMES]
    if _within(module, "owner_reduce.planning"):
        problems += [f"{module} (pure planning) imports {n}" for n in sorted(imported)
                     if any(_within(n, f) for f in PLANNING_FORBIDDEN)
                     or (_within(n, "owner_reduce") and n != "owner_reduce"
                         and not _within(n, "owner_reduce.planning") and not any(_within(n, s) for s in PURE_SHARED))]
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
    for layer in ("planning", "wiring", "runtime", "offline_sizing"):
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
    src = "from harness.launch import run_ranks\nimport torch\n\ndef f():\n    from ..planning import probe\n"
    found = imports_of(src, "owner_reduce.runtime.handle")
    assert {"harness.launch", "owner_reduce.planning.probe", "torch"} <= found
    assert "owner_reduce.wiring.ops" in imports_of("from .ops import x", "owner_reduce.wiring", is_package=True)


@pytest.mark.parametrize(("module", "source"), [
    ("owner_reduce.runtime.handle", "def f():\n    from harness.faults import inject\n"),
    ("owner_reduce.wiring.activation", "import harness.launch\n"),
    ("owner_reduce.planning.sizing", "from research.published_check import published_check\n"),
    ("owner_reduce.offline_sizing.fake_engine", "def f():\n    import research\n"),
    ("owner_reduce.runtime.flush", "from tests.fakes import MirrorComm\n"),
    ("owner_reduce.runtime.flush", "def f():\n    import fakes\n"),  # a test module by the bare name pytest gives it
    ("owner_reduce.wiring.install", "from scripts.size_the_win import main\n"),
    ("owner_reduce.runtime.calibrate", "def f():\n    import gpu_e2e\n"),  # a script by its bare name
    ("owner_reduce.planning.flush_plan", "import torch.distributed as dist\n"),
    ("owner_reduce.planning.owner_map", "from deepspeed.utils import logger\n"),
    ("owner_reduce.planning.probe", "from ..runtime.comm import ReduceComm\n"),
    ("owner_reduce.runtime.comm", "import cupy\n"),
    ("owner_reduce.runtime.nccl_comm", "def f():\n    from cupy.cuda import nccl\n"),
])
def test_negative_control_a_broken_layering_is_refused(module: str, source: str) -> None:
    assert layering_problems(module, imports_of(source, module)), f"{module} with {source!r} passed"


def test_what_the_tooling_rule_allows() -> None:
    # The positive control: a product module named like a script (``runtime.calibrate``, ``scripts/calibrate.py``)
    # is the package's, and so are relative imports, torch and the standard library.
    assert {"calibrate", "fakes", "gpu_e2e", "harness", "research"} <= TOOLING_NAMES
    source = "import os\nimport torch\nfrom . import calibrate\n\ndef f():\n    from ..planning import calibration\n"
    assert layering_problems("owner_reduce.runtime.guard", imports_of(source, "owner_reduce.runtime.guard")) == []


# ---- the tooling is not packaged -----------------------------------------------------------------------------------


def packages_found(include: tuple[str, ...], exclude: tuple[str, ...]) -> list[str]:
    """The packages setuptools finds in the checkout with this filter, as it does for the wheel (pyproject's
    ``[tool.setuptools.packages.find]``, namespaces on: a folder without ``__init__.py`` counts)."""
    setuptools = pytest.importorskip("setuptools")
    return sorted(setuptools.find_namespace_packages(where=str(ROOT), include=include, exclude=exclude))


def tooling_packaged(packages: list[str]) -> list[str]:
    return [p for p in packages if p.partition(".")[0] in TOOLING]


def test_the_tooling_is_beside_the_package_and_not_packaged() -> None:
    tomllib = pytest.importorskip("tomllib")  # python >= 3.11
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find.get("where", ["."]) == ["."] and find.get("namespaces", True)  # the search below is setuptools'
    found = packages_found(tuple(find["include"]), tuple(find.get("exclude", ())))
    assert tooling_packaged(found) == [], found
    assert {name for name, _ in all_modules()} >= set(found) >= {
        "owner_reduce", "owner_reduce.planning", "owner_reduce.planning.algorithms", "owner_reduce.runtime"}
    for folder in ("harness", "research"):
        assert (ROOT / folder / "__init__.py").is_file()
        assert not (PACKAGE / folder).exists(), f"owner_reduce/{folder} is back in the package"


def test_negative_control_unfiltered_the_search_finds_the_tooling() -> None:
    assert {"harness", "research"} <= set(tooling_packaged(packages_found(("*",), ())))


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
              if module_name(path) != THREAD_HOME for line in thread_starts(path.read_text())]
    assert starts == [], f"threads started outside {THREAD_HOME}: {starts}"


def test_negative_control_a_bare_thread_is_seen() -> None:
    assert thread_starts("import threading\nt = threading.Thread(target=print)\n") == [2]
    assert thread_starts("from threading import Thread\n\ndef f():\n    Thread(target=f).start()\n") == [4]


# ---- no import cycle among the package's modules -------------------------------------------------------------------


def import_graph(modules: list[tuple[str, set[str]]]) -> dict[str, list[str]]:
    """Each module's edges to the package's modules it imports (lazy imports too: a cycle closed inside a function is
    still a cycle a newcomer must untangle), in a stable order."""
    names = {name for name, _ in modules}
    return {name: sorted(n for n in imported if n in names and n != name) for name, imported in modules}


def import_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """A cycle of ``graph`` as its modules in import order, the first repeated at the end (``[a, b, a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done (no cycle through it)
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for target in graph[name]:
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[name] = 2
        return None

    for name in graph:
        if name not in state and (found := visit(name)) is not None:
            return found
    return None


def test_the_package_has_no_import_cycle() -> None:
    cycle = import_cycle(import_graph(all_modules()))
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_negative_control_an_import_cycle_is_named() -> None:
    # The shape issue 47 removed: the seam imported the watchdog, the watchdog imported the seam (for its types).
    sources = {"owner_reduce.runtime.comm": "from .watchdog import FlushWatchdog\n",
               "owner_reduce.runtime.watchdog": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                "    from .comm import ReduceComm\n",
               "owner_reduce.runtime.threads": "import threading\n"}
    graph = import_graph([(name, imports_of(src, name)) for name, src in sources.items()])
    assert import_cycle(graph) == ["owner_reduce.runtime.comm", "owner_reduce.runtime.watchdog",
                                   "owner_reduce.runtime.comm"]
    # A longer one, closed by a lazy import.
    sources = {"owner_reduce": "from .wiring import install\n", "owner_reduce.wiring": "from . import install\n",
               "owner_reduce.wiring.install": "def f():\n    import owner_reduce\n"}
    graph = import_graph([(name, imports_of(src, name, name.count(".") < 2)) for name, src in sources.items()])
    assert import_cycle(graph) == ["owner_reduce", "owner_reduce.wiring", "owner_reduce.wiring.install",
                                   "owner_reduce"]
    del sources["owner_reduce.wiring.install"]  # the positive control: no cycle without the lazy import back
    graph = import_graph([(name, imports_of(src, name, name.count(".") < 2)) for name, src in sources.items()])
    assert import_cycle(graph) is None


# ---- a module's private names stay in it ---------------------------------------------------------------------------

# A named tuple's own API is spelled with one underscore but is public (the ``collections.namedtuple`` docs).
NAMED_TUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_definitions(tree: ast.Module) -> set[str]:
    """The private names a module defines for others to reach: its module-level functions, classes and assigned names,
    each class's methods and class attributes, and the attributes it assigns on ``self`` or ``cls`` (a function's
    locals and parameters are no one else's to reach, so a local that shares a name with another library's attribute
    is not counted). A subclass that overrides a hook defines it too, so the template-method hooks of
    ``comm.ReduceComm`` (``_group_start``, ``_split``, ...) are each backend's own names."""
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:  # module or class level: not inside a function
        for node in statements:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found.add(node.name)
            elif isinstance(node, ast.ClassDef):
                found.add(node.name)
                visit(node.body)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, ast.Import | ast.ImportFrom):
                found.update(alias.asname or alias.name.partition(".")[0] for alias in node.names)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    block = getattr(node, field, None)
                    if isinstance(block, list):
                        visit([b for b in block if isinstance(b, ast.stmt)] +
                              [s for h in block if isinstance(h, ast.ExceptHandler) for s in h.body])

    visit(tree.body)
    found.update(node.attr for node in ast.walk(tree)
                 if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                 and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    return {name for name in found if _private(name)}


def private_names_used(sources: dict[str, str]) -> list[str]:
    """Where a module of ``sources`` (module name -> source) uses a private name of another: ``obj._name`` where
    ``_name`` is defined in another module and not in this one, or ``from <a package module> import _name``."""
    trees = {name: ast.parse(source) for name, source in sources.items()}
    defined = {name: private_definitions(tree) for name, tree in trees.items()}
    problems = []
    for module, tree in trees.items():
        elsewhere: dict[str, str] = {}
        for other, names in defined.items():
            if other != module:
                for name in names - defined[module]:
                    elsewhere.setdefault(name, other)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in elsewhere and node.attr not in NAMED_TUPLE_API:
                problems.append(f"{module}:{node.lineno} uses {node.attr} (defined in {elsewhere[node.attr]})")
            elif isinstance(node, ast.ImportFrom):
                target = import_target(node, module, any(_within(m, module) and m != module for m in sources))
                if _within(target, "owner_reduce"):
                    problems += [f"{module}:{node.lineno} imports {alias.name} from {target}" for alias in node.names
                                 if _private(alias.name)]
    return problems


def test_no_module_uses_another_modules_private_name() -> None:
    sources = {module_name(path): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    assert private_names_used(sources) == []


@pytest.mark.parametrize("sources", [
    # the watchdog driving a communicator through a private method defined in the seam's module (before issue 47)
    {"owner_reduce.runtime.comm": "class ReduceComm:\n    def _take_for_abort(self):\n        return None\n",
     "owner_reduce.runtime.watchdog": "def claim(comm):\n    return comm._take_for_abort()\n"},
    # a backend reading the seam's private state
    {"owner_reduce.runtime.comm": "class ReduceComm:\n    def __init__(self):\n        self._in_group = False\n",
     "owner_reduce.runtime.torch_comm": "def f(comm):\n    return comm._in_group\n"},
    # a private function imported from another module, relatively and absolutely
    {"owner_reduce.planning.collective_time": "def _traffic(kind, n):\n    return n\n",
     "owner_reduce.planning.aggregation": "from .collective_time import _traffic\n"},
    {"owner_reduce.planning.collective_time": "def _traffic(kind, n):\n    return n\n",
     "owner_reduce.runtime.flush": "from owner_reduce.planning.collective_time import _traffic\n"},
    # writing another module's private name counts as using it
    {"owner_reduce.runtime.nccl_binding": "_LEFT_OPEN = {}\n",
     "owner_reduce.runtime.nccl_comm": "from . import nccl_binding\nnccl_binding._LEFT_OPEN = None\n"},
])
def test_negative_control_a_private_name_used_across_modules_is_refused(sources: dict[str, str]) -> None:
    assert private_names_used(sources), f"{sources} passed"


def test_what_the_private_name_rule_allows() -> None:
    # The positive controls: a hook overridden in a subclass's module, a named tuple's ``_replace``, a private name of
    # another library (torch's ``_base``), and a private import from outside the package.
    sources = {"owner_reduce.runtime.comm": "class ReduceComm:\n    def _group_start(self):\n        pass\n"
                                            "    def group(self):\n        self._group_start()\n",
               "owner_reduce.runtime.torch_comm": "from .comm import ReduceComm\nclass T(ReduceComm):\n"
                                                  "    def _group_start(self):\n        pass\n",
               "owner_reduce.runtime.flush": "from torch._C import _nvtx\ndef f(call, buf):\n"
                                             "    return call._replace(kind='x'), buf._base\n",
               "owner_reduce.wiring.cpu_compat": "def _replace(module, name, value):\n    pass\n"}
    assert private_names_used(sources) == []
