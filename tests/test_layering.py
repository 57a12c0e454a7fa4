"""The house's shape, held by its imports (STYLE.md): a lower room never imports a higher
one, no package has an import circle, prediction never imports measurement or anything
that runs, and kvlab's own modules are imported at the top of a module, where the graph
can see them."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).parent.parent / "kvlab"
# room -> rank; a module may import rooms of lower or equal rank only. A room may rank some
# of its modules apart ("spec.draft"): speculative decoding's bookkeeping is plain Python the
# scheduler reads, its draft-model and MTP proposers run models
RANKS = {
    "errors": 0, "config": 0, "request": 0, "stop": 0, "heap": 0, "layouts": 0,
    "metrics": 1, "cost": 1, "spec": 2, "spec.verify": 2, "spec.draft": 4, "spec.mtp": 4,
    "tokenizer": 1, "weights": 1, "cache": 1, "scheduler": 2, "kernels": 2, "gpu": 2,
    "logprobs": 2, "output": 2, "models": 3, "runner": 4, "sampler": 4, "structured": 4,
    "engine": 5, "llm": 6,
    "estimate": 6, "probe": 7, "server": 8, "harness": 8, "cli": 9, "deploy": 9,
}
NO_TORCH = {"cache", "scheduler", "config", "request", "errors", "stop", "cost", "output",
            "spec"}
# prediction is arithmetic over specs: nothing that loads or runs a model, and no probe
NOT_FROM = {
    "estimate": {"kernels", "models", "runner", "sampler", "structured", "engine", "llm",
                 "probe"},
}
# `import kvlab` stays light: LLM (and torch behind it) loads on first use (PEP 562)
LAZY_ALLOWED = {"kvlab/__init__.py"}


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "kvlab" or len(parts) < 2:
        return ""
    return ".".join(parts[1:3]) if ".".join(parts[1:3]) in RANKS else parts[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path) -> list[str]:
    """Every module an import statement needs: `from package import submodule` needs the
    submodule (its package's own names are not read), `from module import name` the module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            if all(s in MODULES or s in EXTENSIONS for s in subs):
                found.extend(subs)
            else:
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
    return found


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}
EXTENSIONS = {"kvlab.kernels._qk", "kvlab.kernels._qk_emu512", "kvlab.tokenizer._tok"}  # C


def test_imports_point_down():
    bad = []
    for name, path in MODULES.items():
        here = room(name)
        if here not in RANKS:
            continue
        for mod in imports(path):
            there = room(mod)
            if there in RANKS and RANKS[there] > RANKS[here]:
                bad.append(f"{name} imports {mod}")
            if there in NOT_FROM.get(here, ()):
                bad.append(f"{name} imports {mod}: {here} must not import {there}")
            if here in NO_TORCH and mod.split(".")[0] == "torch":
                bad.append(f"{name} imports torch")
    assert not bad, "\n".join(bad)


def test_every_room_has_a_rank():
    rooms = {room(name) for name in MODULES if name.count(".") >= 1}
    rooms = {r for r in rooms if (ROOT / r).is_dir() or (ROOT / f"{r}.py").exists()}
    assert rooms <= set(RANKS) | {"__init__", "__main__"}, sorted(rooms - set(RANKS))


def _graph() -> dict[str, set[str]]:
    """kvlab module -> the kvlab modules it imports (a package stands for its __init__)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in MODULES.items():
        for mod in imports(path):
            if mod in EXTENSIONS:
                continue
            while mod and mod not in MODULES:  # `from kvlab.x import name`: kvlab.x
                mod = mod.rpartition(".")[0]
            if mod and mod != name and mod != "kvlab":
                graph[name].add(mod)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert not circles(_graph()), circles(_graph())


def test_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _optional(tree: ast.AST) -> set[int]:
    """Nodes inside a `try:` that catches ImportError: a module behind an optional extra."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError",
                                                               "ModuleNotFoundError")
                for h in node.handlers):
            found.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return found


def test_kvlab_imports_at_module_top():
    """An import inside a function hides an edge from the graph above; kvlab's own modules
    are imported at the top, but for one behind an optional extra (Ray Serve), imported in
    a `try:` that turns its ImportError into advice."""
    bad = []
    for name, path in MODULES.items():
        if str(path.relative_to(ROOT.parent)) in LAZY_ALLOWED:
            continue
        tree = ast.parse(path.read_text())
        optional = _optional(tree)
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if id(node) in optional:
                    continue
                mod = (node.module if isinstance(node, ast.ImportFrom) else
                       next((a.name for a in node.names), "")
                       if isinstance(node, ast.Import) else "")
                if (mod or "").split(".")[0] == "kvlab":
                    bad.append(f"{name}.{fn.name} imports {mod} (line {node.lineno})")
    assert not bad, "\n".join(bad)


def _imported_names(path: Path) -> list[str]:
    """Every module and module.name an import in `path` names (relative ones resolved)."""
    package = ".".join(path.relative_to(ROOT.parent).parent.parts)
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level - 1` levels up
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names += [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


# what each server package may import from kvlab.server: its own modules and these
SERVER_ALLOWED = {"core": set(), "replicas": {"core", "apis"}}
API_ALLOWED = {"core"}


def test_each_api_is_a_translation_layer_over_core():
    """kvlab.server.core knows no API; each API package (OpenAI, Anthropic, Ollama, the
    visualiser, ...) imports core and never another API; only the visualiser reaches the
    estimator and the probe. Each imported name counts on its own, so `from kvlab.server
    import viz` is caught too."""
    bad = []
    for package in sorted(p for p in (ROOT / "server").iterdir()
                          if p.is_dir() and (p / "__init__.py").exists()):
        allowed = SERVER_ALLOWED.get(package.name, API_ALLOWED) | {package.name}
        banned = () if package.name == "viz" else ("kvlab.estimate", "kvlab.probe")
        for path in package.rglob("*.py"):
            for n in _imported_names(path):
                parts = n.split(".")
                other_api = parts[:2] == ["kvlab", "server"] and len(parts) > 2 \
                    and parts[2] not in allowed
                if other_api or any(n == b or n.startswith(b + ".") for b in banned):
                    bad.append(f"{package.name}/{path.name} imports {n}")
    assert not bad, "\n".join(bad)


def test_prediction_loads_no_torch():
    """The estimator and the probe's cache are arithmetic and a JSON file: importing every
    module of estimate/ (and what `--hardware this` reads) loads neither torch nor the C
    kernels, so `kvlab estimate` starts in a moment."""
    modules = [name for name in MODULES if name.startswith("kvlab.estimate")]
    code = (f"import sys\nfor m in {modules + ['kvlab.probe']!r}: __import__(m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'"
            " or m.startswith('kvlab.kernels')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", out

