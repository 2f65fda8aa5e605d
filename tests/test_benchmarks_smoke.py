"""Every benchmark runs in its tiny smoke mode on CPU (no timing assertions: speed targets live
in the benchmarks themselves, measured on the GPU and recorded in docs/benchmarks.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["quant_bandwidth.py", "linear_fwd_bwd.py"])
def test_benchmark_smoke(script, tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["results"] and all(r["ms"] > 0 for r in data["results"])
    assert "|" in proc.stdout
