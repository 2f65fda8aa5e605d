"""Shared pytest set-up: the ``gpu`` marker skips with the hardware check's own reason."""

import json
import os
import re

import pytest

# Under pytest-xdist every worker would start as many intra-op threads as the machine has cores;
# on a 2-core machine two workers x two threads oversubscribe the cores and the suite runs about
# 3x slower. Each worker (and the processes it starts) gets an equal share instead, unless
# OMP_NUM_THREADS is set already. Tests whose numbers depend on the thread count pin it themselves.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
if _WORKERS > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // _WORKERS)))

import torch  # noqa: E402  (after OMP_NUM_THREADS)

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Without a GPU, Triton kernels run under Triton's CPU interpreter (tests/quant/test_triton_kernels.py).
# The variable is read when Triton is imported, so it is set before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.report import NUMERICS_REPORT  # noqa: E402  (after the environment above)
from helpers.skips import gpu_skip_reason, te_skip_reason  # noqa: E402

# Module/session-scoped fixtures that take many seconds to build (sets of training runs); cheap
# shared fixtures are left out so their tests still spread over the workers.
SHARED_FIXTURES = {"dist_runs", "sweep", "smoke", "bridge_runs", "seeds"}


def _files_with_shared_fixtures() -> set:
    """Test files (relative to the repository, as in pytest's test ids) that define a fixture of
    :data:`SHARED_FIXTURES` with module or session scope."""
    here = os.path.dirname(os.path.abspath(__file__))
    pattern = re.compile(r'@pytest\.fixture\(scope="(?:module|session)"\)\s*\ndef (\w+)\(')
    out = set()
    for folder, _, names in sorted(os.walk(here)):
        for name in sorted(names):
            if name.startswith("test_") and name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    if SHARED_FIXTURES & set(pattern.findall(f.read())):
                        rel = os.path.relpath(os.path.join(folder, name), os.path.dirname(here))
                        out.add(rel.replace(os.sep, "/"))
    return out


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist's default ``--dist load``, the tests of a file that defines one of
    :data:`SHARED_FIXTURES` are one unit of work, sent to one worker, so the fixture (a set of
    training runs) is built once rather than once per worker; every other test is its own unit
    and spreads over the workers as with ``load``. (Grouping by ``xdist_group`` markers would be
    finer, but pytest-xdist's ``loadgroup`` does not see the markers' suffix under pytest 9.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    files = _files_with_shared_fixtures()

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path in files else nodeid

    return SharedFixtureScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    te_reason = te_skip_reason() if any(item.get_closest_marker("te") for item in items) else None
    for item in items:
        if "gpu" in item.keywords and reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
        if item.get_closest_marker("te") is not None and te_reason is not None:
            item.add_marker(pytest.mark.skip(reason=te_reason))


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
