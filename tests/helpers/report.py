"""Numerics tables that tests fill and the run prints at its end (tests/conftest.py)."""

# Numerics tables collected by tests (e.g. error vs the exact float64 GEMM per recipe and GEMM)
# and printed at the end of every run, so CI logs carry the numbers.
NUMERICS_REPORT = {}
