"""The layout's import rules, checked by walking every import of engine/ and serve_app/ with `ast`.

Every `import` and `from ... import` counts, at module level and inside functions (`from x import y`
where y is a module imports x.y); those under `if TYPE_CHECKING:` never run and do not count.
"Imports, transitively" follows every import of each project module it reaches; a package's
`__init__` also runs when one of its modules is imported, and its module-level imports count then
(its function-level ones run when its attributes are used, as serve_app's lazy `build_app`).

- serve_app never imports jax, jaxlib, equinox, haliax or levanter, itself or through the engine
  modules it imports;
- neither does the engine's pure layer (`PURE_LAYER`: what the serving layer and the drivers use);
- lower layers never import higher ones (`FORBIDDEN`): formats never imports a model, layers never
  import a backend or a model, errors / stats / config import no other engine module;
- serve_app/http and serve_app/protocol never import transformers (the ingress process);
- no cycle between modules, nor between packages (folders);
- ruff is clean on engine/ and serve_app/.

A failure names the offending import as file:line and the chain of imports that reaches it.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "serve_app")
JAX = ("jax", "jaxlib", "equinox", "haliax", "levanter")

PURE_LAYER = (
    "engine.errors", "engine.stats", "engine.config", "engine.worker", "engine.ladder", "engine.tasks",
    "engine.generate.request", "engine.generate.scheduler", "engine.generate.pages", "engine.step.buckets",
    "engine.generate.planner", "engine.generate.speculation", "engine.generate.grammar",
    "engine.generate.adapters", "engine.generate.images", "engine.generate.driver",
    "engine.embed.driver", "engine.transcribe.driver", "engine.transcribe.decoding", "engine.transcribe.alignment",
)
"""Besides these, every module directly in engine/generate/ but engine.py (the managers beside the scheduler)."""
IMPURE_GENERATE = ("engine.generate.engine",)

FORBIDDEN = {
    "engine.formats": ("engine.models", "engine.layers", "engine.backends", "engine.generate", "engine.embed",
                       "engine.transcribe"),
    "engine.layers": ("engine.backends", "engine.models", "engine.generate.runner", "engine.generate.executor",
                      "engine.generate.engine"),
    "engine.errors": ("engine.",),
    "engine.stats": ("engine.",),
    "engine.config": ("engine.",),
}
"""Importing package or module -> the project modules it never imports, directly or transitively
(a prefix names a package and everything in it)."""
FORBIDDEN_EXCEPT = {"engine.errors": ("engine.errors",), "engine.stats": ("engine.stats", "engine.errors"),
                    "engine.config": ("engine.config", "engine.errors")}
"""What the lowest modules may import of the engine after all: each other, below them."""

REPLICA_ONLY = {
    ("serve_app.replicas.base", "engine.formats.model_sources"):
        "a model-server replica resolves (and may convert) its checkpoint before it loads the engine, in the "
        "process that runs the engine",
}
"""Imports from serve_app into the engine that the jax check does not follow, each with why."""


# ---- the import graph ----


@dataclasses.dataclass(frozen=True)
class Import:
    source: str
    """The importing module."""
    line: int
    target: str
    """A project module, or an outside module's dotted name."""
    lazy: bool
    """Inside a function."""


class Graph:
    """Every import of the project's modules under `root`."""

    def __init__(self, root: Path, packages: tuple[str, ...] = PACKAGES):
        self.root = root
        self.files = {_module_name(path, root): path for pkg in packages for path in sorted((root / pkg).rglob("*.py"))}
        self.imports = {module: _imports(module, path, self.files) for module, path in self.files.items()}

    def where(self, imp: Import) -> str:
        """file:line of `imp`, and whether it is inside a function."""
        path = self.files[imp.source].relative_to(self.root)
        return f"{path}:{imp.line}{' (in a function)' if imp.lazy else ''}"

    def project_module(self, name: str) -> str | None:
        """The project module `name` imports (its longest dotted prefix that is one), else None."""
        while name not in self.files:
            if "." not in name:
                return None
            name = name.rsplit(".", 1)[0]
        return name

    def package(self, module: str) -> str:
        """The folder `module` sits in, as a dotted name."""
        return module if self.files[module].name == "__init__.py" else module.rsplit(".", 1)[0]

    def parents(self, module: str) -> list[str]:
        parts = module.split(".")
        return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in self.files]

    def edges(self, module: str) -> list[tuple[Import, str]]:
        """(the import, the project module it imports) for `module`'s imports of project modules."""
        found = ((imp, self.project_module(imp.target)) for imp in self.imports[module])
        return [(imp, target) for imp, target in found if target is not None and target != module]

    def reach(self, start: str, skip=lambda imp, target: False) -> tuple[dict[str, Import | None], set[str]]:
        """Every project module `start` imports, transitively (see the module doc), each with the import
        that first reached it (None for `start`), and those of them imported themselves (not only run
        as a package above one); `skip(import, target)`: an import not to follow."""
        reached: dict[str, Import | None] = {start: None}
        whole = {start}
        queue = collections.deque([start])
        while queue:
            module = queue.popleft()
            for imp, target in self.edges(module):
                if (imp.lazy and module not in whole) or skip(imp, target):
                    continue
                for found, itself in [(target, True), *((p, False) for p in self.parents(target))]:
                    if found not in reached or (itself and found not in whole):
                        reached.setdefault(found, imp)
                        whole.update([found] if itself else [])
                        queue.append(found)
        return reached, whole

    def chain(self, reached: dict[str, Import | None], module: str) -> str:
        """How `module` was reached: the imports from the start, as file:line."""
        hops = []
        while reached[module] is not None:
            hops.append(self.where(reached[module]))
            module = reached[module].source
        return " <- ".join(hops) if hops else "(itself)"

    def outside_imports(self, start: str, roots: tuple[str, ...], skip=lambda imp, target: False) -> list[str]:
        """Each import of an outside package named in `roots` by `start` or a module it reaches."""
        reached, whole = self.reach(start, skip)
        found = []
        for module in reached:
            for imp in self.imports[module]:
                outside = imp.target.split(".")[0] in roots and self.project_module(imp.target) is None
                if outside and (module in whole or not imp.lazy):
                    found.append(f"{self.where(imp)} imports {imp.target}, reached from {start} by: "
                                 f"{self.chain(reached, module)}")
        return found


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(module: str, path: Path, files: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:
                    visit_one(other, lazy)
            else:
                visit_one(child, lazy)

    def visit_one(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(module, node.lineno, alias.name, lazy) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append(Import(module, node.lineno, submodule if submodule in files else base, lazy))
        else:
            visit(node, lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return list(dict.fromkeys(found))  # `from x import a, b`: one import of x


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def forbidden_imports(graph: Graph, rules: dict[str, tuple[str, ...]],
                      allowed: dict[str, tuple[str, ...]]) -> list[str]:
    """Each import, direct or transitive, of a project module `rules` forbids to its importer."""
    found = []
    for rule, banned in rules.items():
        for module in (m for m in graph.files if m == rule or m.startswith(rule + ".")):
            reached, imported = graph.reach(module)
            for target in imported:
                if _under(target, banned) and target not in allowed.get(rule, ()) and not _under(target, (rule,)):
                    found.append(f"{graph.where(reached[target])}: {module} imports {target}, which {rule} never "
                                 f"imports; by: {graph.chain(reached, target)}")
    return found


def _under(module: str, names: tuple[str, ...]) -> bool:
    return any(module == n or module.startswith(n if n.endswith(".") else n + ".") for n in names)


def cycles(nodes: dict[str, list[tuple[str, str]]]) -> list[list[str]]:
    """The strongly connected components of more than one node of a graph given as node ->
    [(neighbour, where the edge is written)], each as its nodes (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(nodes[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, neighbours = work[-1]
            for neighbour, _ in neighbours:
                if neighbour not in index:
                    index[neighbour] = low[neighbour] = len(index)
                    stack.append(neighbour)
                    on_stack.add(neighbour)
                    work.append((neighbour, iter(nodes.get(neighbour, []))))
                    break
                if neighbour in on_stack:
                    low[node] = min(low[node], index[neighbour])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def describe_cycle(component: list[str], nodes: dict[str, list[tuple[str, str]]]) -> str:
    """A shortest cycle through the component, each step with where its import is written."""
    members = set(component)
    shortest: list[tuple[str, str]] = []
    for start in sorted(component):
        came: dict[str, tuple[str, str]] = {}
        queue = collections.deque([start])
        while queue and start not in came:
            node = queue.popleft()
            for neighbour, where in nodes.get(node, []):
                if neighbour in members and neighbour not in came:
                    came[neighbour] = (node, where)
                    queue.append(neighbour)
        steps, node = [], start
        while True:
            node, where = came[node][0], came[node][1]
            steps.append((node, where))
            if node == start:
                break
        if not shortest or len(steps) < len(shortest):
            shortest = steps[::-1]
    path = shortest[0][0] + "".join(f" -> {nxt} ({where})" for (_, where), (nxt, _) in
                                    zip(shortest, shortest[1:] + shortest[:1]))
    return f"{', '.join(sorted(component))}: {path}"


def module_graph(graph: Graph) -> dict[str, list[tuple[str, str]]]:
    return {m: [(target, graph.where(imp)) for imp, target in graph.edges(m)] for m in graph.files}


def package_graph(graph: Graph) -> dict[str, list[tuple[str, str]]]:
    """Packages (a folder with all it holds) and their imports of each other: an import between two
    folders neither of which holds the other is an edge between the two sibling folders that hold
    them (engine/generate/runner/x.py importing engine/backends/y.py: engine.generate ->
    engine.backends). A folder's own modules importing its subfolders' (and back) is its own business."""
    packages: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    for module in graph.files:
        for imp, target in graph.edges(module):
            source_parts, target_parts = graph.package(module).split("."), graph.package(target).split(".")
            common = 0
            while common < min(len(source_parts), len(target_parts)) and source_parts[common] == target_parts[common]:
                common += 1
            if common < min(len(source_parts), len(target_parts)):  # neither folder holds the other
                packages[".".join(source_parts[:common + 1])].append((".".join(target_parts[:common + 1]),
                                                                      graph.where(imp)))
    return dict(packages)


def pure_layer(graph: Graph) -> list[str]:
    generate = [m for m in graph.files if m.startswith("engine.generate.") and m.count(".") == 2
                and graph.files[m].name != "__init__.py" and m not in IMPURE_GENERATE]
    return sorted(set(PURE_LAYER) | set(generate))


# ---- the project's rules ----


@pytest.fixture(scope="module")
def graph() -> Graph:
    return Graph(ROOT)


def _report(problems: list[str], rule: str) -> str:
    return f"{len(problems)} import(s) break the rule that {rule}:\n  " + "\n  ".join(problems)


def test_serve_app_never_imports_jax(graph):
    skip = lambda imp, target: (imp.source, target) in REPLICA_ONLY  # noqa: E731
    problems = [p for m in graph.files if m.split(".")[0] == "serve_app" for p in graph.outside_imports(m, JAX, skip)]
    assert not problems, _report(sorted(set(problems)), "serve_app never imports jax, jaxlib, equinox, haliax or "
                                 "levanter (the engine class is imported by its path string, on the replicas)")


def test_the_engines_pure_layer_never_imports_jax(graph):
    missing = [m for m in PURE_LAYER if m not in graph.files]
    assert not missing, f"PURE_LAYER names modules that do not exist (renamed? update the list): {missing}"
    problems = [p for m in pure_layer(graph) for p in graph.outside_imports(m, JAX)]
    assert not problems, _report(sorted(set(problems)), "the engine's pure layer (what serve_app and the drivers "
                                 "import) never imports jax, jaxlib, equinox, haliax or levanter")


def test_lower_layers_never_import_higher_ones(graph):
    problems = forbidden_imports(graph, FORBIDDEN, FORBIDDEN_EXCEPT)
    assert not problems, _report(sorted(set(problems)), "formats never import models, layers, backends or "
                                 "an engine; layers never import backends or models; errors, stats and config "
                                 "import no other engine module")


def test_the_ingress_never_imports_transformers(graph):
    ingress = [m for m in graph.files if m.startswith(("serve_app.http", "serve_app.protocol"))]
    problems = [p for m in ingress for p in graph.outside_imports(m, ("transformers",))]
    assert not problems, _report(sorted(set(problems)), "serve_app/http and serve_app/protocol never import "
                                 "transformers (the ingress process tokenizes nothing)")


def test_no_cycle_between_modules(graph):
    nodes = module_graph(graph)
    found = cycles(nodes)
    assert not found, "import cycles between modules (counting imports inside functions):\n  " + "\n  ".join(
        describe_cycle(c, nodes) for c in found)


def test_no_cycle_between_packages(graph):
    nodes = package_graph(graph)
    found = cycles(nodes)
    assert not found, ("import cycles between packages (folders, each with its subfolders; counting imports inside "
                       "functions):\n  " + "\n  ".join(describe_cycle(c, nodes) for c in found))


def test_ruff_is_clean_on_engine_and_serve_app():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "engine", "serve_app"], cwd=ROOT,
                          capture_output=True, text=True)
    if "No module named ruff" in proc.stderr:
        pytest.fail("ruff is not installed in this environment: pip install -e '.[dev]'")
    assert proc.returncode == 0, f"ruff check engine serve_app ([tool.ruff]):\n{proc.stdout}{proc.stderr}"


# ---- the checks themselves, on a made-up tree ----


def _tree(tmp_path: Path, files: dict[str, str]) -> Graph:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return Graph(tmp_path, ("app", "eng"))


def test_the_walk_sees_imports_in_functions_relative_imports_and_submodules(tmp_path):
    graph = _tree(tmp_path, {
        "app/__init__.py": "def __getattr__(name):\n    from app import heavy\n",
        "app/heavy.py": "import jax\n",
        "app/front.py": "from eng import pure\n",
        "eng/__init__.py": "",
        "eng/pure.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import jax\n"
                       "def later():\n    from . import model\n",
        "eng/model.py": "import haliax.nn as hnn\n",
    })
    problems = graph.outside_imports("app.front", JAX)
    assert problems == ["eng/model.py:1 imports haliax.nn, reached from app.front by: "
                        "eng/pure.py:5 (in a function) <- app/front.py:1"]
    assert graph.outside_imports("eng.pure", JAX) == [
        "eng/model.py:1 imports haliax.nn, reached from eng.pure by: eng/pure.py:5 (in a function)"]
    assert graph.reach("app.front") == (
        {"app.front": None, "eng.pure": graph.imports["app.front"][0], "eng": graph.imports["app.front"][0],
         "eng.model": graph.imports["eng.pure"][1]}, {"app.front", "eng.pure", "eng.model"})


def test_a_package_init_counts_its_module_level_imports_only(tmp_path):
    graph = _tree(tmp_path, {
        "app/__init__.py": "def __getattr__(name):\n    from app import heavy\n",
        "app/heavy.py": "import jax\n",
        "app/front.py": "import json\n",
        "app/sub/__init__.py": "import jaxlib\n",
        "app/sub/leaf.py": "",
        "app/user.py": "from app.sub import leaf\n",
        "eng/__init__.py": "",
    })
    assert graph.outside_imports("app.front", JAX) == []
    assert graph.outside_imports("app.user", JAX) == [
        "app/sub/__init__.py:1 imports jaxlib, reached from app.user by: app/user.py:1"]
    assert graph.outside_imports("app", JAX) != []  # the package itself: its own functions count


def test_cycles_are_found_through_imports_in_functions(tmp_path):
    graph = _tree(tmp_path, {
        "app/__init__.py": "",
        "app/a.py": "from app import b\n",
        "app/b.py": "def f():\n    import app.a\n",
        "eng/__init__.py": "",
        "eng/low/__init__.py": "",
        "eng/low/x.py": "def f():\n    from eng.high import y\n",
        "eng/high/__init__.py": "",
        "eng/high/y.py": "from eng.low import x\n",
    })
    nodes = module_graph(graph)
    assert sorted(cycles(nodes)) == [["app.a", "app.b"], ["eng.high.y", "eng.low.x"]]
    assert describe_cycle(["app.a", "app.b"], nodes) == (
        "app.a, app.b: app.a -> app.b (app/a.py:1) -> app.a (app/b.py:2 (in a function))")
    assert cycles(package_graph(graph)) == [["eng.high", "eng.low"]]


def test_a_folder_and_its_subfolders_are_one_package(tmp_path):
    graph = _tree(tmp_path, {
        "app/__init__.py": "",
        "eng/__init__.py": "",
        "eng/base.py": "",
        "eng/select.py": "from eng.sub import impl\n",
        "eng/sub/__init__.py": "",
        "eng/sub/impl.py": "from eng import base\nfrom eng.other import x\n",
        "eng/other/__init__.py": "",
        "eng/other/x.py": "",
    })
    assert package_graph(graph) == {"eng.sub": [("eng.other", "eng/sub/impl.py:2")]}
    assert cycles(package_graph(graph)) == []


def test_a_forbidden_import_names_the_line_and_the_chain(tmp_path):
    graph = _tree(tmp_path, {
        "app/__init__.py": "",
        "eng/__init__.py": "",
        "eng/formats/__init__.py": "",
        "eng/formats/reader.py": "from eng import helper\n",
        "eng/helper.py": "def f():\n    from eng.models import model\n",
        "eng/models/__init__.py": "",
        "eng/models/model.py": "",
    })
    problems = forbidden_imports(graph, {"eng.formats": ("eng.models",)}, {})
    assert problems == [
        "eng/helper.py:2 (in a function): eng.formats.reader imports eng.models.model, which eng.formats never "
        "imports; by: eng/helper.py:2 (in a function) <- eng/formats/reader.py:1",
    ]
