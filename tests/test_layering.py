"""Imports only point down the house (STYLE.md): a lower room never imports a higher one."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent / "kvlab"
# room -> rank; a module may import rooms of lower or equal rank only
RANKS = {
    "errors": 0, "config": 0, "request": 0, "stop": 0, "metrics": 1,
    "tokenizer": 1, "weights": 1, "cache": 1, "scheduler": 2, "kernels": 2,
    "models": 3, "runner": 4, "sampler": 4, "structured": 4, "engine": 5, "llm": 6,
    "perf": 6, "server": 7, "bench": 7, "cli": 8, "deploy": 8,
}
NO_TORCH = {"cache", "scheduler", "config", "request", "errors", "stop"}


def room(module: str) -> str:
    return module.split(".")[1] if module.startswith("kvlab.") else ""


def imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
    return found


def test_imports_point_down():
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        here = rel.parts[1] if len(rel.parts) > 1 else ""
        if here not in RANKS:
            continue
        for mod in imports(path):
            there = room(mod)
            if there in RANKS and RANKS[there] > RANKS[here]:
                bad.append(f"{rel} imports {mod}")
            if here in NO_TORCH and mod.split(".")[0] == "torch":
                bad.append(f"{rel} imports torch")
    assert not bad, "\n".join(bad)
