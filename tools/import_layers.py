"""Checks the project's import structure with `ast`: no import cycle between modules or between units
(packages and root modules), no unit importing one above it in `LAYERS`, and no `CORE` module reaching a
`PERIPHERY` unit.

    python -m tools.import_layers            # prints the package graph; exit 1 on a violation

Every `import` / `from ... import` of a project module counts, deferred ones inside functions too.
"""
import ast
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Lowest first. A unit may import units of its own layer or below, never above. A root module is its own
# unit (its file name without .py), a package is the unit of every module in it.
LAYERS = [
    ["tread_utils"],
    ["routing_module"],
    ["backbones", "tread_diffusers", "edm", "rectified_flow", "data"],
    ["dit", "evaluations"],
    ["generation"],
    ["training"],
    ["train", "sample", "fid", "tools"],
    ["lab"],
    ["tests"],
]
# Adapters for other libraries' models, for the users who bring those models: no module that the CORE modules
# import, directly or through others, deferred imports too, imports them. A module-level `__getattr__` (PEP 562)
# runs only when an importer asks it for a name, so its imports count as that importer's, not the module's.
PERIPHERY = ["tread_diffusers"]
CORE = ["train", "sample", "fid", "dit"]
SKIP_DIRS = {"docs", "configs", "scripts", "build"}


def project_modules(repo: Path = REPO) -> dict:
    """module name -> path, for the root modules and every module of the project's packages."""
    found = {}
    for path in sorted(repo.rglob("*.py")):
        rel = path.relative_to(repo)
        if rel.parts[0] in SKIP_DIRS or rel.parts[0].startswith(".") or "site-packages" in rel.parts:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(path: Path, module: str, modules: dict, lazy_attributes: bool = True) -> set:
    """The project modules that `path` imports (the longest known prefix of each imported name); without those
    of a module-level `__getattr__` when `lazy_attributes` is false."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if not lazy_attributes:
        tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "__getattr__")]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names += [f"{base}.{alias.name}" for alias in node.names] + [base]
    found = set()
    for name in names:
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            candidate = ".".join(parts[:k])
            if candidate in modules:
                if candidate != module:
                    found.add(candidate)
                break
    return found


def unit(module: str) -> str:
    return module.split(".")[0]


def layer_of(name: str) -> int:
    for level, units in enumerate(LAYERS):
        if name in units:
            return level
    raise KeyError(name)


def find_cycle(graph: dict):
    """One import cycle among modules as a list, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def core_reaching_periphery(modules: dict) -> list:
    """One line per way a CORE module reaches into the PERIPHERY: the chain of imports that gets there."""
    graph = {m: imports_of(p, m, modules, lazy_attributes=False) for m, p in modules.items()}
    found = []
    for start in (m for m in CORE if m in graph):
        chain, todo = {start: None}, [start]
        while todo:
            m = todo.pop()
            for nxt in sorted(graph[m] - chain.keys()):
                chain[nxt] = m
                todo.append(nxt)
        for m in sorted(m for m in chain if unit(m) in PERIPHERY and unit(chain[m]) not in PERIPHERY):
            path = [m]
            while chain[path[-1]] is not None:
                path.append(chain[path[-1]])
            found.append(f"{start} reaches {m} ({' -> '.join(reversed(path))}): CORE imports no PERIPHERY unit")
    return found


def analyse(repo: Path = REPO):
    """(module graph, unit graph, problems): problems lists every cycle, unplaced unit, upward import and CORE
    module reaching the PERIPHERY."""
    modules = project_modules(repo)
    graph = {m: imports_of(p, m, modules) for m, p in modules.items()}
    units = defaultdict(set)
    problems = []
    for m, targets in graph.items():
        for t in targets:
            if unit(t) != unit(m):
                units[unit(m)].add(unit(t))
    for name in sorted({unit(m) for m in modules}):
        try:
            layer_of(name)
        except KeyError:
            problems.append(f"{name} is in no layer of tools/import_layers.py LAYERS")
    for m, targets in sorted(graph.items()):
        for t in sorted(targets):
            try:
                if layer_of(unit(t)) > layer_of(unit(m)):
                    problems.append(f"{m} imports {t}, a layer above it")
            except KeyError:
                pass
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import cycle: " + " -> ".join(cycle))
    # Units too: a package and a module of the same layer that import each other through different modules
    # form no module cycle, yet neither can be understood, or imported first, without the other.
    cycle = find_cycle(units)
    if cycle:
        problems.append("import cycle between units: " + " -> ".join(cycle))
    problems += core_reaching_periphery(modules)
    return graph, dict(units), problems


def main() -> int:
    _, units, problems = analyse()
    for level in reversed(range(len(LAYERS))):
        for name in LAYERS[level]:
            print(f"{level}  {name:16s} -> {', '.join(sorted(units.get(name, ()))) or '-'}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
