"""The package's import graph flows one way: no module imports, at module level or inside a
function, a module that imports it back (directly or through others). Package ``__init__``
re-exports are not edges (they gather the public API, importing a package's submodules).
No module grows past the size limit, and ``NEMO_FP8_*`` variables are read in
``nemo_fp8_recipes/options.py`` only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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


# ---- module size and environment ------------------------------------------------------------------
#: modules allowed past the size limit, with the reason (none today)
_LONG_MODULES: dict = {}
_MAX_LINES = 650


def test_no_library_module_is_over_the_size_limit():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > _MAX_LINES and str(p.relative_to(ROOT)) not in _LONG_MODULES}
    assert not long, f"modules over {_MAX_LINES} lines (split them by concern, or list them with a reason): {long}"


def _nemo_env_reads(tree) -> list:
    """``NEMO_FP8_*`` names a module reads: ``os.environ.get/[...]``, ``os.getenv``, ``environ.get``."""
    found = []
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("get", "getenv", "pop", "setdefault"):
                arg = node.args[0]
        elif isinstance(node, ast.Subscript):
            arg = node.slice
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("NEMO_FP8_"):
            found.append(arg.value)
    return found


def test_nemo_fp8_environment_variables_are_read_in_the_options_module_only():
    reads = {str(p.relative_to(ROOT)): r for p in ROOT.rglob("*.py")
             if p.name != "options.py" and (r := _nemo_env_reads(ast.parse(p.read_text())))}
    assert not reads, f"NEMO_FP8_* read outside nemo_fp8_recipes/options.py: {reads}"


def test_the_environment_read_finder_finds_a_read():
    tree = ast.parse('import os\nx = os.environ.get("NEMO_FP8_X")\ny = os.environ["NEMO_FP8_Y"]\nz = os.getenv("NEMO_FP8_Z")')
    assert _nemo_env_reads(tree) == ["NEMO_FP8_X", "NEMO_FP8_Y", "NEMO_FP8_Z"]


def test_settings_read_from_the_environment(monkeypatch, tmp_path):
    from nemo_fp8_recipes.data import default_cache_dir
    from nemo_fp8_recipes.distributed import _timeout_minutes
    from nemo_fp8_recipes.options import env_setting

    monkeypatch.setenv("NEMO_FP8_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("NEMO_FP8_DIST_TIMEOUT_MIN", raising=False)
    assert _timeout_minutes() == 30
    monkeypatch.setenv("NEMO_FP8_DIST_TIMEOUT_MIN", "90")
    assert _timeout_minutes() == 90
    monkeypatch.setenv("NEMO_FP8_DIST_TIMEOUT_MIN", "soon")
    with pytest.raises(ValueError, match="NEMO_FP8_DIST_TIMEOUT_MIN='soon'"):
        _timeout_minutes()
    with pytest.raises(KeyError, match="known: cache_dir, dist_timeout_min"):
        env_setting("cache")
