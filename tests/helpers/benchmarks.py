"""Importing a benchmark script as its own command line would."""

import os


def import_benchmark(name: str):
    """The module ``benchmarks/<name>.py``, imported with ``benchmarks/`` on ``sys.path`` as when the
    script runs (it may import its siblings), which is taken off again afterwards."""
    import importlib
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
    sys.path.insert(0, path)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(path)
