"""The package's import graph flows one way: no module imports, at module level or inside a
function, a module that imports it back (directly or through others). Package ``__init__``
re-exports are not edges (they gather the public API, importing a package's submodules).
The modules form layers, and nothing imports upward (core vocabulary -> quantisation and policy ->
nn -> models and data -> configuration -> trainer / integrations / launch -> command lines;
``compare`` stands apart); a module's ``__all__`` names what it defines; no private name is
imported across modules; nothing outside ``nn/linear.py`` touches ``Float8Linear``'s private
members; ``NEMO_FP8_*`` variables are read in ``nemo_fp8_recipes/options.py`` only; no test file imports
another test file or conftest (what they share is in ``tests/helpers``)."""

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


def _imports(name: str, path: Path, mods, packages: bool = False) -> set:
    """The modules of ours that ``name`` imports anywhere in it; ``packages``: count imports of a
    package (its ``__init__``) too, which the cycle check leaves out (a facade gathers its package)."""
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
            if t in mods and t != name and (packages or mods[t].name != "__init__.py"):
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

    code = (
        "import torch.optim.optimizer as o, nemo_fp8_recipes.nn as nn_;"
        "from nemo_fp8_recipes.recipes import get_recipe;"
        "n0 = len(o._global_optimizer_post_hooks);"
        "[nn_.Float8Linear(128, 128, recipe=get_recipe('tensorwise'), emulate=True) for _ in range(2)];"
        "print(n0, len(o._global_optimizer_post_hooks))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "1"]


# ---- layers ---------------------------------------------------------------------------------------
#: The package's layers, lowest first: a module imports from its own layer and those below it only.
#: Module names are matched by their longest listed prefix. ``compare`` stands apart: it imports
#: nothing of the package but itself, and any layer may use it.
LAYERS = {
    "nemo_fp8_recipes.formats": 0,
    "nemo_fp8_recipes.hardware": 0,
    "nemo_fp8_recipes.recipes": 0,
    "nemo_fp8_recipes.options": 0,
    "nemo_fp8_recipes.versions": 0,
    "nemo_fp8_recipes._io": 0,
    "nemo_fp8_recipes.determinism": 0,
    "nemo_fp8_recipes.policy": 1,
    "nemo_fp8_recipes.quant": 1,
    "nemo_fp8_recipes.nn": 2,
    "nemo_fp8_recipes.models": 3,
    "nemo_fp8_recipes.data": 3,
    "nemo_fp8_recipes.config": 4,
    "nemo_fp8_recipes.trainer": 5,
    "nemo_fp8_recipes.integrations": 5,
    "nemo_fp8_recipes.launch": 5,
    # the command lines
    "nemo_fp8_recipes.train": 6,
    "nemo_fp8_recipes.trainer.cli": 6,
    "nemo_fp8_recipes.integrations.bridge.cli": 6,
    "nemo_fp8_recipes.launch.submit": 6,
}
LAYER_NAMES = (
    "core vocabulary",
    "quantisation and policy",
    "nn",
    "models and data",
    "configuration",
    "trainer / integrations / launch",
    "command lines",
)
APART = "nemo_fp8_recipes.compare"


def _layer(name: str):
    if name == APART or name.startswith(APART + "."):
        return "apart"
    if name.endswith(".__main__"):  # python -m <package>: a command line
        return 6
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LAYERS:
            return LAYERS[key]
    return None


def _upward(graph) -> list:
    """``(importer, imported)`` edges that point to a higher layer, or out of ``compare``. Package
    ``__init__`` modules gather their package's API and are not importers here."""
    bad = []
    for src, targets in graph.items():
        ls = _layer(src)
        for t in sorted(targets):
            lt = _layer(t)
            if ls == "apart":
                if lt != "apart":
                    bad.append((src, t))
            elif lt not in ("apart", None) and ls is not None and lt > ls:
                bad.append((src, t))
    return bad


def test_nothing_imports_upward():
    mods = _modules()
    unplaced = sorted(m for m in mods if m != "nemo_fp8_recipes" and _layer(m) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"
    graph = {m: _imports(m, p, mods, packages=True) for m, p in mods.items() if p.name != "__init__.py"}
    bad = [
        f"{a} ({LAYER_NAMES[_layer(a)] if _layer(a) != 'apart' else 'compare'}) imports {b} "
        f"({LAYER_NAMES[_layer(b)] if _layer(b) != 'apart' else 'compare'})"
        for a, b in _upward(graph)
    ]
    assert not bad, "imports pointing upward:\n" + "\n".join(bad)


def test_the_layering_check_finds_an_upward_import():
    graph = {
        "nemo_fp8_recipes.nn.linear": {"nemo_fp8_recipes.quant.ops", "nemo_fp8_recipes.trainer.run"},
        "nemo_fp8_recipes.trainer.run": {"nemo_fp8_recipes.nn.linear", "nemo_fp8_recipes.compare.reading"},
        "nemo_fp8_recipes.compare.reading": {"nemo_fp8_recipes.config"},
    }
    assert _upward(graph) == [
        ("nemo_fp8_recipes.nn.linear", "nemo_fp8_recipes.trainer.run"),
        ("nemo_fp8_recipes.compare.reading", "nemo_fp8_recipes.config"),
    ]


def _defined_names(tree) -> set:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
        elif isinstance(node, ast.If):  # names defined under a guard (e.g. an optional import's fallback)
            names |= _defined_names(ast.Module(body=node.body + node.orelse, type_ignores=[]))
    return names


def _all_names(tree) -> list:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return []


def test_a_module_exports_only_what_it_defines():
    """``__all__`` lists names the module defines; a package's ``__init__`` (its facade) aside."""
    bad = {}
    for p in ROOT.rglob("*.py"):
        if p.name == "__init__.py":
            continue
        tree = ast.parse(p.read_text())
        foreign = sorted(set(_all_names(tree)) - _defined_names(tree))
        if foreign:
            bad[str(p.relative_to(ROOT))] = foreign
    assert not bad, f"__all__ names a module does not define (import them from where they live): {bad}"


def test_no_private_name_is_imported_across_modules():
    bad = []
    for p in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("nemo_fp8_recipes")):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    bad.append(
                        f"{p.relative_to(ROOT)}: from {'.' * node.level}{node.module or ''} import {', '.join(private)}"
                    )
    assert not bad, "private names imported from another module (make them public where they live):\n" + "\n".join(bad)


# ---- Float8Linear's private members ---------------------------------------------------------------
def _private_members(path: Path, class_name: str) -> set:
    """The ``_``-prefixed names a class of ``path`` defines: methods, class attributes and
    ``self._x = ...`` assignments; not dunders, not the ``nn.Module`` internals it overrides or
    uses (``_apply``, ``_buffers``, ...), which every module has and siblings may reach."""
    import torch.nn as nn

    cls = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == class_name)
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    for node in cls.body:
        for t in (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        ):
            if isinstance(t, ast.Name):
                names.add(t.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__") and not hasattr(nn.Module, n)}


def _private_accesses(source: str, names: set) -> list:
    """``line: <expr>.<name>`` for every attribute access to one of ``names`` on anything but
    ``self`` / ``cls`` (a class's own members are its business)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append((node.lineno, node.col_offset, f"{node.lineno}: {ast.unparse(node)}"))
    return [hit for *_, hit in sorted(found)]


FLOAT8_LINEAR = ROOT / "nn" / "linear.py"


def test_nothing_outside_the_fp8_linear_touches_its_private_members():
    """``Float8Linear``'s state is its own: sibling modules (scaling, telemetry, convert, autograd,
    integrations, the trainer) and the benchmarks and scripts use its public methods and its
    ``config``. (Tests may look inside.)"""
    names = _private_members(FLOAT8_LINEAR, "Float8Linear")
    assert {"_config", "_commit", "_quantize_operand", "_pending"} <= names  # (the finder sees them)
    bad = []
    files = [*ROOT.rglob("*.py"), *(ROOT.parent / "benchmarks").rglob("*.py"), *(ROOT.parent / "scripts").rglob("*.py")]
    for p in files:
        if p == FLOAT8_LINEAR:
            continue
        bad += [f"{p.relative_to(ROOT.parent)}:{hit}" for hit in _private_accesses(p.read_text(), names)]
    assert not bad, "Float8Linear's private members used outside nn/linear.py (give it a public method):\n" + (
        "\n".join(bad)
    )


def test_the_private_member_check_finds_a_violation():
    names = _private_members(FLOAT8_LINEAR, "Float8Linear")
    source = (
        "def sync(model):\n"
        "    for m in fp8_modules(model).values():\n"
        "        m._commit(0)\n"
        "        m._scale_generation += 1\n"
        "        self._pending = []  # a class's own attribute: fine\n"
        "        m._buffers.clear()  # nn.Module's: fine\n"
    )
    assert _private_accesses(source, names) == ["3: m._commit", "4: m._scale_generation"]


# ---- environment ----------------------------------------------------------------------------------
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
    reads = {
        str(p.relative_to(ROOT)): r
        for p in ROOT.rglob("*.py")
        if p.name != "options.py" and (r := _nemo_env_reads(ast.parse(p.read_text())))
    }
    assert not reads, f"NEMO_FP8_* read outside nemo_fp8_recipes/options.py: {reads}"


def test_the_environment_read_finder_finds_a_read():
    tree = ast.parse(
        'import os\nx = os.environ.get("NEMO_FP8_X")\ny = os.environ["NEMO_FP8_Y"]\nz = os.getenv("NEMO_FP8_Z")'
    )
    assert _nemo_env_reads(tree) == ["NEMO_FP8_X", "NEMO_FP8_Y", "NEMO_FP8_Z"]


def test_settings_read_from_the_environment(monkeypatch, tmp_path):
    from nemo_fp8_recipes.data import default_cache_dir
    from nemo_fp8_recipes.options import env_setting
    from nemo_fp8_recipes.trainer.distributed import _timeout_minutes

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


# ---- lint and format ------------------------------------------------------------------------------
REPO = ROOT.parent


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff_passes(command):
    """``ruff check`` and ``ruff format --check`` with the repository's ruff.toml (the dev extra
    installs the pinned ruff): fix with ``ruff check --fix . && ruff format .``."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]' installs the pinned version)")
    out = subprocess.run([ruff, *command], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[
        -6000:
    ] + f"\n(fix: ruff check --fix . && ruff format .; {sys.executable})"


def test_the_licence_is_stated_where_users_look():
    """LICENSE holds the Apache License 2.0, and the package metadata and the README name it."""
    import subprocess
    import sys

    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    meta = subprocess.run(
        [sys.executable, "setup.py", "--license", "--classifiers"], cwd=REPO, capture_output=True, text=True
    )
    assert "Apache-2.0" in meta.stdout and "License :: OSI Approved :: Apache Software License" in meta.stdout
    assert "Apache License 2.0 ([LICENSE](LICENSE))" in (REPO / "README.md").read_text(encoding="utf-8")


# ---- the tests' own layout --------------------------------------------------------------------------
TESTS = Path(__file__).resolve().parent


def _test_module_imports(source: str) -> list:
    """The modules an imported test file takes from other test files or from conftest."""
    out = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out += [n for n in names if n.split(".")[0] == "conftest" or n.split(".")[-1].startswith("test_")]
    return out


def test_no_test_module_imports_another_or_conftest():
    """What test files share lives in tests/helpers (imported as ``helpers.<module>``); fixtures and
    hooks in conftest, which pytest loads itself."""
    bad = []
    for p in sorted(TESTS.rglob("*.py")):
        found = _test_module_imports(p.read_text(encoding="utf-8"))
        if found and "golden" not in p.parts:  # (the golden regeneration script runs the golden test's run)
            bad.append(f"{p.relative_to(TESTS)}: {', '.join(found)}")
    assert not bad, (
        "test files importing test modules or conftest (move the shared code to tests/helpers):\n" + "\n".join(bad)
    )


def test_the_test_import_finder_finds_one():
    assert _test_module_imports("from test_compare import raw_scalars\nimport conftest\nfrom helpers.x import y") == [
        "test_compare",
        "conftest",
    ]
