"""The package's import graph flows one way: no module imports, at module level or inside a
function, a module that imports it back (directly or through others). Package ``__init__``
re-exports are not edges (they gather the public API, importing a package's submodules)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "nemo_fp8_recipes"


def _modules():
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


def _imports(name: str, path: Path, mods) -> set:
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            base = pkg
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            mod = node.module if not node.level else (f"{base}.{node.module}" if node.module else base)
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            while t not in mods and "." in t:
                t = t.rpartition(".")[0]
            if t in mods and t != name and mods[t].name != "__init__.py":
                out.add(t)
    return out


def _cycles(graph) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycles():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert len(graph) > 40 and graph["nemo_fp8_recipes.nn.linear"]  # the graph was read
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_importing_the_package_installs_no_optimizer_hook():
    """The FP8 weight cache's global optimizer hook is registered by the first FP8 linear, once,
    not by ``import nemo_fp8_recipes`` (a fresh interpreter, so no other test's modules count)."""
    import subprocess
    import sys

    code = ("import torch.optim.optimizer as o, nemo_fp8_recipes.nn as nn_;"
            "from nemo_fp8_recipes.recipes import get_recipe;"
            "n0 = len(o._global_optimizer_post_hooks);"
            "[nn_.Float8Linear(128, 128, recipe=get_recipe('tensorwise'), emulate=True) for _ in range(2)];"
            "print(n0, len(o._global_optimizer_post_hooks))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "1"]
