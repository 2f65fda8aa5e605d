"""Shared pytest set-up: the ``gpu`` marker skips with the hardware check's own reason."""

import json
import os

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's CPU interpreter (tests/test_triton_kernels.py).
# The variable is read when Triton is imported, so it is set before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def gpu_skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none found: CPU-only machine); run these tests on a CUDA GPU"
    return None


def te_skip_reason():
    """Why the ``te`` tests cannot run here (None when Transformer Engine imports on a GPU)."""
    gpu = gpu_skip_reason()
    if gpu is not None:
        return f"Transformer Engine {gpu}"
    from nemo_fp8_recipes.integrations.te import te_available

    ok, why = te_available()
    return None if ok else f"Transformer Engine is not importable here ({why}); pip install '.[te]' on this GPU machine"


# Module/session-scoped fixtures that take many seconds to build (sets of training runs); cheap
# shared fixtures are left out so their tests still spread over the workers.
SHARED_FIXTURES = {"dist_runs", "sweep", "smoke", "bridge_runs"}


def pytest_configure(config):
    """Under pytest-xdist (``-n``), tests that share an expensive module- or session-scoped fixture
    of this suite (a set of training runs, a Megatron model) run on one worker, so the fixture is
    built once rather than once per worker: ``--dist load`` becomes ``loadgroup`` with the groups
    that :func:`_group_shared_fixtures` assigns; every other test is load-balanced as before."""
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"


def _group_shared_fixtures(items) -> None:
    """An ``xdist_group`` per set of tests connected through the fixtures of :data:`SHARED_FIXTURES`
    that they request (autouse ones included)."""
    here = os.path.dirname(os.path.abspath(__file__))
    parent = {}

    def find(k):
        while parent.setdefault(k, k) != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    shared = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        names = []
        for name, defs in (info.name2fixturedefs.items() if info else ()):
            d = defs[-1]
            path = os.path.abspath(getattr(d.func, "__code__", None).co_filename) if hasattr(d.func, "__code__") else ""
            if name in SHARED_FIXTURES and d.scope in ("module", "session") and path.startswith(here):
                names.append(f"{path}::{name}")
        if names:
            shared[item] = names
            for n in names[1:]:
                parent[find(n)] = find(names[0])
    for item, names in shared.items():
        item.add_marker(pytest.mark.xdist_group(os.path.basename(find(names[0])).replace(".py::", ":")))


def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "dist", "no") == "loadgroup":
        _group_shared_fixtures(items)
    reason = gpu_skip_reason()
    te_reason = te_skip_reason() if any(item.get_closest_marker("te") for item in items) else None
    for item in items:
        if "gpu" in item.keywords and reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
        if item.get_closest_marker("te") is not None and te_reason is not None:
            item.add_marker(pytest.mark.skip(reason=te_reason))


# Numerics tables collected by tests (e.g. error vs the exact float64 GEMM per recipe and GEMM)
# and printed at the end of every run, so CI logs carry the numbers.
NUMERICS_REPORT = {}


def pytest_sessionfinish(session, exitstatus):
    """Under pytest-xdist (``-n``) each worker sends its tables to the controller, which prints them."""
    out = getattr(session.config, "workeroutput", None)  # set on xdist workers only
    if out is not None:
        out["numerics_report"] = json.dumps(NUMERICS_REPORT)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller merges a finished worker's tables (one header per table)."""
    for title, rows in json.loads(getattr(node, "workeroutput", {}).get("numerics_report", "{}")).items():
        merged = NUMERICS_REPORT.setdefault(title, [])
        merged.extend(rows[1:] if merged and rows and rows[0] == merged[0] else rows)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for title, rows in NUMERICS_REPORT.items():
        terminalreporter.write_sep("-", title)
        for line in rows:
            terminalreporter.write_line(line)
