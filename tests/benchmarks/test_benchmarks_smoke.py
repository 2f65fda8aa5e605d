"""Every benchmark runs in its tiny smoke mode on CPU (no timing assertions: speed targets live
in the benchmarks themselves, measured on the GPU and recorded in docs/performance.md)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_linear_fwd_bwd_smoke(tmp_path):
    import torch

    data = _run_smoke("linear_fwd_bwd.py", tmp_path)
    assert data["results"] and all(r["ms"] > 0 for r in data["results"])
    if not torch.cuda.is_available():  # (the NVML monitor samples a GPU's timings only)
        assert all(r["gpu"] is None and r["gpu_reason"] == "not monitored" for r in data["results"])


def test_quant_bandwidth_smoke(tmp_path):
    """``quant_bandwidth.py --smoke`` in one run (Triton's interpreter where there is no GPU:
    tests/conftest.py sets it): the table with every quantiser variant (the one-read 1x128 pair of
    ``benchmarks/fp8_kernels`` and the 128x128 weight pairs included), then ``--sweep`` — each
    configuration's codes checked against the default's, ``cols_t128_bf16`` tuning ``cols_t128``,
    ``dual128`` the benchmarks' kernel — and ``--host-overhead``, every part and wrapper timed."""
    triton = _has_triton() and os.environ.get("TRITON_INTERPRET") == "1"
    extra = ["--sweep", "rows128,cols_t128_bf16,tensor_delayed,dual128", "--host-overhead"] if triton else []
    data = _run_smoke("quant_bandwidth.py", tmp_path, *extra)
    assert data["results"] and all(r["ms"] > 0 for r in data["results"])
    if not triton:
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from quant_bandwidth import VARIANTS
    finally:
        sys.path.pop(0)
    triton_rows = {r["variant"] for r in data["results"] if r["impl"] == "triton"}
    assert triton_rows == {v[0] for v in VARIANTS}, sorted({v[0] for v in VARIANTS} - triton_rows)
    rows = data["sweep"]
    assert [(r["kernel"], r["default"]) for r in rows] == [
        (k, d) for k in ("rows128", "cols_t128", "tensor_delayed", "dual128") for d in (True, False)
    ]
    assert all(r["same_bits"] is True and r["error"] is None and r["ms"] > 0 for r in rows)
    assert rows[3]["config"] == {"bf16_tile": False, "block_c": 128, "num_warps": 4, "groups": 1}
    host = data["host_overhead"]
    assert len(host) == 14 and all(h["host_us"] > 0 and h["host_us_triton_launch"] > 0 for h in host)
    assert any("Triton launch alone" in h["what"] for h in host)
    assert any("compiled graph: x * 1.5 -> tensor_pair" in h["what"] for h in host)


def test_quant_bandwidth_refuses_an_unknown_sweep_kernel_before_measuring(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import quant_bandwidth
    finally:
        sys.path.pop(0)
    with pytest.raises(SystemExit) as e:
        quant_bandwidth.main(["--smoke", "--sweep", "rows64"])
    assert e.value.code == 2 and "valid: all, rows128" in capsys.readouterr().err


def test_linear_breakdown_attributes_the_step_to_kernel_classes(tmp_path):
    """``linear_fwd_bwd.py --breakdown``: every variant gets a profile whose classes add up to the
    profiled kernel time; on CPU the GEMM class is the matmuls (ATen ``mm``)."""
    proc, data = _smoke("linear_fwd_bwd.py", tmp_path, "--breakdown", "--recipes", "tensorwise")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = data["results"]
    assert [r["recipe"] for r in rows] == ["bf16", "tensorwise"]
    for r in rows:
        b = r["breakdown"]
        assert b["kernels_ms"] > 0 and b["gemm"] > 0
        assert abs(b["gemm"] + b["quantise (Triton)"] + b["attention"] + b["other"] - b["kernels_ms"]) < 1e-6
        if b["source"].startswith("CPU"):  # a smoke run on a GPU host profiles CUDA kernels instead
            assert any(name == "aten::mm" and calls >= 6 for name, _, calls in b["top"])
    assert "where the time goes" in proc.stdout


def test_linear_benchmark_cuda_graph_column(tmp_path):
    """``linear_fwd_bwd.py --cuda-graph --fused-wgrad``: every variant gets a CUDA-graph time and
    its ratio on a GPU, or (CPU) no number and the reason, listed under the table; the fused
    variants follow their unfused ones and get the like-for-like ratio."""
    import torch

    proc, data = _smoke("linear_fwd_bwd.py", tmp_path, "--cuda-graph", "--fused-wgrad", "--recipes", "tensorwise")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = data["results"]
    assert [r["recipe"] for r in rows] == ["bf16", "bf16+fused", "tensorwise", "tensorwise+fused"]
    assert "CUDA graph" in proc.stdout and "vs BF16+fused" in proc.stdout
    fused_base = next(r for r in rows if r["recipe"] == "bf16+fused")
    assert abs(fused_base["speedup_b2b_vs_bf16_fused"] - 1.0) < 1e-9
    for r in rows:
        if torch.cuda.is_available():
            assert r["graph_status"] == "ok" and r["ms_graph"] > 0 and r["speedup_graph"] > 0
        else:
            assert r["graph_status"] == "CUDA only" and r["ms_graph"] is None and r["speedup_graph"] is None
    if not torch.cuda.is_available():
        assert "no CUDA-graph time for: tiny bf16: CUDA only" in proc.stdout


def test_layer_breakdown_profiles_each_variant_and_mode(tmp_path):
    """``layer_fwd_bwd.py --breakdown``: a profile per variant and mode, classes adding up, the
    attention core attributed to its own class (CPU: ``aten::_scaled_dot_product...``)."""
    proc, data = _smoke(
        "layer_fwd_bwd.py", tmp_path, "--breakdown", "--variants", "bf16,tensorwise", "--modes", "eager"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = data["results"]
    assert [(r["variant"], r["mode"]) for r in rows] == [("bf16", "eager"), ("tensorwise", "eager")]
    for r in rows:
        b = r["breakdown"]
        assert b["gemm"] > 0 and b["attention"] > 0
        assert abs(b["gemm"] + b["quantise (Triton)"] + b["attention"] + b["other"] - b["kernels_ms"]) < 1e-6
    assert "where the time goes" in proc.stdout


def test_back_to_back_timing_is_per_call_and_runs_every_window(bench_modules):
    """``bench(window=...)``: per-call milliseconds (not per window), ``warmup + iters * window``
    calls cycling over the input sets."""
    import time as _time

    _timing = bench_modules[0]
    calls = []

    def fn(i):
        calls.append(i)
        _time.sleep(0.004)

    ms = _timing.bench(fn, 3, window=3, iters=4, warmup=1)
    assert len(calls) == 1 + 4 * 3 and calls[:5] == [0, 0, 1, 2, 0]
    assert 4.0 <= ms < 3 * 4.0  # one call's sleep, not a window's


def test_interleaved_timing_alternates_the_variants_every_round(bench_modules, profiling):
    """``--rounds``: each round times every variant in turn (its synchronised samples, then its
    back-to-back windows), so clock drift is shared; medians and sample counts over all rounds;
    ``rounds=1`` is the sequential order. A monitor is entered around each block's synchronised
    and back-to-back samples and keeps its samples over the rounds; without one there are none."""
    _timing = bench_modules[0]
    calls = []

    def make(name):
        return lambda i: calls.append(name)

    class Monitor:  # records which calls ran inside it
        made = []

        def __init__(self, device):
            self.samples, self.reason = [], "counted"
            Monitor.made.append(self)

        def __enter__(self):
            self.start = len(calls)
            return self

        def __exit__(self, *exc):
            self.samples.append(calls[self.start :])

        def summary(self):
            return {"blocks": [set(b) for b in self.samples], "calls": sum(map(len, self.samples))}

    fns = {"bf16": make("bf16"), "fp8": make("fp8")}
    out = _timing.bench_interleaved(fns, 3, "cpu", rounds=2, warmup=1, iters=4, window=2, b2b_warmup=0, monitor=Monitor)
    blocks = [n for k, n in enumerate(calls) if k == 0 or calls[k - 1] != n]
    assert blocks == ["bf16", "fp8", "bf16", "fp8"]
    # first round: 1 warm-up + 2 synchronised samples + 2 windows of 2 calls; later rounds: one
    # warm-up call after the switch
    assert calls.count("bf16") == (1 + 2 + 4) + (1 + 2 + 4)
    assert len(Monitor.made) == 4  # one per variant and kind of sample
    for k in fns:
        assert out[k]["samples"] == {"ms": 4, "ms_b2b": 4, "ms_graph": 0}
        assert out[k]["ms"] >= 0 and out[k]["ms_graph"] is None
        assert out[k]["gpu"] == {"blocks": [{k}, {k}], "calls": 2 * (1 + 2)} and out[k]["gpu_reason"] == "counted"
        assert out[k]["gpu_b2b"] == {"blocks": [{k}, {k}], "calls": 2 * 4}
    calls.clear()
    out = _timing.bench_interleaved(fns, 3, "cpu", rounds=1, warmup=1, iters=4, window=2)
    assert [n for k, n in enumerate(calls) if k == 0 or calls[k - 1] != n] == ["bf16", "fp8"]
    assert out["bf16"]["gpu"] is None and out["bf16"]["gpu_reason"] == "not monitored"
    # the NVML monitor off a GPU: nothing sampled, and why
    out = _timing.bench_interleaved(
        fns, 3, "cpu", rounds=1, warmup=1, iters=2, window=2, monitor=profiling.nvml.GpuMonitor
    )
    assert out["fp8"]["gpu"] is None and out["fp8"]["gpu_reason"] == "no CUDA device"
    assert _timing.gpu_monitor("cpu") is None and _timing.gpu_monitor("cuda:0") is profiling.nvml.GpuMonitor


def test_timeline_stats_splits_busy_idle_and_the_first_step(profiling):
    """``--breakdown``'s GPU timeline (the CUDA trace is read on the H200): busy is the union of
    kernel intervals (an overlapping kernel is not counted twice), the first step's idle is kept
    apart from the later steps', whose idle splits into the lead before each step's first kernel
    and the in-step gaps, charged to the pair of kernels around them."""
    iv = [
        (0, 10, "a"),
        (12, 20, "b"),
        (18, 30, "c"),  # step 1: idle 2 us, c overlaps b
        (40, 50, "a"),
        (50, 60, "b"),
        (70, 80, "c"),  # step 2: idle 10 before a, 10 before c
        (85, 90, "a"),
        (90, 95, "b"),
        (95, 100, "c"),
    ]  # step 3: idle 5 before a
    t = profiling.timeline.timeline_stats(list(reversed(iv)), steps=3)
    assert t["kernels"] == 3
    assert math.isclose(t["span"], 100 / 3 / 1e3)
    assert math.isclose(t["busy"], (10 + 8 + 10 + 10 + 10 + 10 + 5 + 5 + 5) / 3 / 1e3)
    assert math.isclose(t["idle_first"], 2 / 1e3)
    assert math.isclose(t["idle_steady"], (20 + 5) / 2 / 1e3)
    assert math.isclose(t["span"] * 3, t["busy"] * 3 + t["idle_first"] + t["idle_steady"] * 2)
    # the gaps before steps 2 and 3's first kernels (10 and 5 us) are the lead, the rest in-step
    assert math.isclose(t["lead"], (10 + 5) / 2 / 1e3)
    assert math.isclose(t["idle_in_step"], 10 / 2 / 1e3)
    assert t["gap_sites"] == [["b -> c", 10 / 2 / 1e3, 0.5]]
    assert profiling.timeline.timeline_stats([], steps=3)["busy"] == 0.0


def test_live_at_peak_replays_an_allocator_trace(profiling, tmp_path):
    """``--peak-report``'s trace replay (the CUDA run is on the H200): the peak is taken at the
    right event, blocks freed before it are not listed, blocks allocated before the trace count
    in ``before_gib`` (and their frees lower the running total), and an Inductor frame is named
    with its line and source-node comment."""
    code = tmp_path / "torchinductor_x" / "ab" / "cab.py"
    code.parent.mkdir(parents=True)
    code.write_text(
        "def call(args):\n    # Topologically Sorted Source Nodes: [silu, mul]\n"
        "    buf3 = empty_strided_cuda((8192, 14336), (14336, 1), torch.bfloat16)\n"
    )
    mib = 2**20
    ind = [{"filename": str(code), "line": 3, "name": "call"}]
    ours = [
        {"filename": "/x/site-packages/torch/_ops.py", "line": 1, "name": "__call__"},
        {"filename": "/r/nemo_fp8_recipes/quant/triton_kernels.py", "line": 712, "name": "quantize_rows"},
    ]
    ev = [
        {"action": "alloc", "addr": 1, "size": 100 * mib, "frames": ind},
        {"action": "alloc", "addr": 2, "size": 50 * mib, "frames": ours},
        {"action": "free_requested", "addr": 1, "size": 100 * mib},
        {"action": "free_completed", "addr": 1, "size": 100 * mib},
        {"action": "free_requested", "addr": 99, "size": 10 * mib},  # a block from before the trace
        {"action": "alloc", "addr": 3, "size": 120 * mib, "frames": ind},  # peak: 1000-10+50+120
        {"action": "free_requested", "addr": 3, "size": 120 * mib},
        {"action": "alloc", "addr": 4, "size": 30 * mib, "frames": []},
    ]
    r = profiling.memory.live_at_peak(ev, base_bytes=1000 * mib)
    assert r["peak_gib"] * 1024 == pytest.approx(1160)
    assert r["during_gib"] * 1024 == pytest.approx(170) and r["before_gib"] * 1024 == pytest.approx(990)
    assert [round(t[0]) for t in r["top"]] == [120, 50]
    assert r["top"][0][1].startswith("cab.py:3 call: buf3 = empty_strided_cuda((8192, 14336)")
    assert r["top"][0][1].endswith("# Topologically Sorted Source Nodes: [silu, mul]")
    assert r["top"][1][1] == "triton_kernels.py:712 quantize_rows"


def test_peak_memory_report_records_one_step_and_turns_the_history_off(profiling, monkeypatch):
    """``peak_memory_report`` around CUDA's allocator-history calls (faked here; the H200 runs them
    for real): the step runs once between enabling and disabling the history, the replay starts
    from the memory allocated before it, and the history is turned off even when the step fails."""
    import torch

    mib, calls = 2**20, []
    ev = [{"action": "alloc", "addr": 1, "size": 64 * mib, "frames": []}]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 100 * mib)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda.memory, "_record_memory_history", lambda enabled="all", **kw: calls.append(("history", enabled))
    )
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"device_traces": [ev]})
    r = profiling.memory.peak_memory_report(lambda i: calls.append(("step", i)), 3)
    assert calls == ["sync", ("history", "all"), ("step", 3), "sync", ("history", None)]
    assert r["peak_gib"] * 1024 == pytest.approx(164) and r["before_gib"] * 1024 == pytest.approx(100)
    calls.clear()

    def fail(i):
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        profiling.memory.peak_memory_report(fail)
    assert calls[-1] == ("history", None)


def test_kernel_classes_of_gpu_kernel_names(profiling):
    classify_kernel = profiling.timeline.classify_kernel
    assert classify_kernel("sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert classify_kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert classify_kernel("cast_dual_kernel") == "quantise (Triton)"
    assert classify_kernel("delayed_commit_kernel") == "quantise (Triton)"
    assert classify_kernel("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, ...>") == "attention"
    assert classify_kernel("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert classify_kernel("void at::native::vectorized_elementwise_kernel<4, ...>") == "other"


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _smoke(script, tmp_path, *args, timeout=300, cwd=None):
    """``benchmarks/<script> --smoke --out <tmp_path>/r.json`` with ``args``: (the finished
    process, the JSON it wrote or None)."""
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    return proc, json.loads(out.read_text()) if out.exists() else None


def _run_smoke(script, tmp_path, *args):
    """:func:`_smoke` that must succeed and print a Markdown table: its JSON."""
    proc, data = _smoke(script, tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "|---|" in proc.stdout  # a Markdown table
    assert data is not None, "no JSON written"
    return data


def _finite_positive(v):
    return isinstance(v, float) and math.isfinite(v) and v > 0


@pytest.fixture
def bench_modules(monkeypatch):
    """Import the benchmark scripts in-process (they live outside the package)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _timing
    import gemm_tflops
    import layer_fwd_bwd

    return _timing, gemm_tflops, layer_fwd_bwd


@pytest.fixture
def profiling(monkeypatch):
    """The benchmarks' optional profiling package (``benchmarks/profiling``)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import profiling.memory
    import profiling.nvml
    import profiling.timeline

    return profiling


def test_gemm_tflops_smoke(tmp_path):
    data = _run_smoke("gemm_tflops.py", tmp_path)
    rows = data["results"]
    # emulated on CPU: every variant, mxfp8 included, for both projections and all three GEMMs
    keys = {(r["gemm"], r["pass"], r["variant"]) for r in rows}
    assert keys == {
        (g, p, v)
        for g in ("fc1 (gate or up)", "fc2 (down)")
        for p in ("fprop", "dgrad", "wgrad")
        for v in ("bf16", "per-tensor", "blockwise", "mxfp8")
    }
    for r in rows:
        assert r["status"] == "ok" and all(_finite_positive(r[k]) for k in ("ms", "tflops", "speedup")), r
        assert r["M"] * r["N"] * r["K"] > 0
    wgrad = {r["variant"]: r for r in rows if r["pass"] == "wgrad" and r["gemm"] == "fc2 (down)"}
    assert (wgrad["per-tensor"]["M"], wgrad["per-tensor"]["N"], wgrad["per-tensor"]["K"]) == (256, 384, 256)


def test_gemm_tflops_energy_rows(tmp_path):
    """``--energy``: every variant of every GEMM gets an energy record from its back-to-back
    window — on CPU the time (and the call count) with the reason the joules are missing, on a
    GPU with NVML joules per call and a draw that match the time; a second table is printed."""
    proc, data = _smoke("gemm_tflops.py", tmp_path, "--energy", "0.02", "--variants", "bf16,blockwise")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Energy: each variant back to back" in proc.stdout
    assert data["energy_s"] == 0.02
    rows = data["results"]
    assert {r["variant"] for r in rows} == {"bf16", "blockwise"} and len(rows) == 12
    for r in rows:
        e = r["energy"]
        assert e["calls"] >= 3 and _finite_positive(e["ms"]) and _finite_positive(e["tflops"])
        if e["j"] is None:
            assert e["energy_reason"] and e["w"] is None and e["gflop_per_j"] is None
        else:
            assert e["energy_reason"] is None and math.isclose(e["w"], e["j"] / (e["ms"] / 1e3))
    bad = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gemm_tflops.py"), "--smoke", "--energy", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--energy is a duration" in bad.stderr


def _scripted_counter(t, busy, idle_w=100.0, busy_w=700.0, refresh_s=0.02, frozen=False):
    """A :class:`GpuMonitor` (CPU: no NVML) whose energy counter, like NVML's, integrates the
    draw (``idle_w`` always, ``busy_w`` during the ``busy`` intervals) but shows it only at
    refreshes every ``refresh_s`` (``frozen``: never advances)."""
    import time as _time

    t0 = _time.perf_counter()

    class Counter(t.GpuMonitor):
        def energy_mj(self):
            now = _time.perf_counter()
            if frozen:
                return 1000
            tick = t0 + (now - t0) // refresh_s * refresh_s
            extra = sum(max(0.0, min(tick, b) - a) for a, b in busy)
            return int((idle_w * (tick - t0) + (busy_w - idle_w) * extra) * 1e3)

    mon = Counter("cpu")
    mon.reason = None
    return mon, t0


def test_energy_of_counts_the_work_between_counter_refreshes(profiling):
    """:func:`_energy_of` against a counter that shows its integral only at refreshes (every
    20 ms): 100 W idle, 700 W while the work runs (0.3 s, ending 1 ms after a refresh). A read
    right after the work would miss 19 ms of it (13 J of 210, 6%); waiting for the next refresh
    and subtracting the idle draw over that wait gives the work's joules. A counter that does
    not advance, and a window shorter than the idle correction, give no joules and say why."""
    import time as _time

    t = profiling.nvml
    busy = []
    mon, t0 = _scripted_counter(t, busy)

    def work(seconds=0.3):
        a = _time.perf_counter()
        end = a + seconds
        end = t0 + ((end - t0) // 0.02 + 1) * 0.02 + 0.001  # (1 ms after a refresh)
        while _time.perf_counter() < end:
            pass
        busy.append((a, _time.perf_counter()))
        return 300.0

    ms, joules, extra = t._energy_of(mon, work)
    assert ms == 300.0
    want = 700.0 * (busy[0][1] - busy[0][0])
    assert abs(joules - want) < 0.02 * want, (joules, want, extra)
    # (the idle draw comes from two refresh reads 20 ms apart, whose timing a busy CI host can
    # delay by a few ms; its error times the ~20 ms wait is well under a joule)
    assert abs(extra["idle_w"] - 100.0) < 30.0 and 10.0 < extra["counter_wait_ms"] <= 45.0
    assert mon.reason is None
    frozen, _ = _scripted_counter(t, [], frozen=True)
    assert t._energy_of(frozen, lambda: 1.0) == (1.0, None, None)
    assert "did not advance" in frozen.reason
    # work of 0 W over a window: the idle correction leaves nothing (or less): no joules, a reason
    quiet, _ = _scripted_counter(t, [], idle_w=100.0)
    assert t._energy_of(quiet, lambda: 1.0)[1:] == (None, None)
    assert "too short" in quiet.reason


def test_grouped_timing_keeps_the_costly_call_of_each_cycle(bench_modules):
    """``group=K``: with one costly call in every K (the micro-batch that re-quantises the
    weights), every synchronised sample is a whole cycle, so the median includes it; the
    back-to-back window is rounded up to whole cycles. Without it the median leaves it out."""
    import time as _time

    t, _, _ = bench_modules
    calls = [0]

    def fn(i):  # 60 ms every third call, 1 ms otherwise
        _time.sleep(0.060 if calls[0] % 3 == 0 else 0.001)
        calls[0] += 1

    grouped = t.bench_interleaved({"f": fn}, 2, "cpu", rounds=1, warmup=1, iters=5, window=4, group=3)["f"]
    plain = t.bench_interleaved({"f": fn}, 2, "cpu", rounds=1, warmup=1, iters=5, window=4)["f"]
    # (62 ms / 3 = 20.7 ms per call; a busy host only lengthens the sleeps a little)
    assert 18.0 < grouped["ms"] < 35.0 and 18.0 < grouped["ms_b2b"] < 35.0, grouped
    assert plain["ms"] < 12.0, plain


@pytest.mark.gpu
def test_energy_window_reads_the_boards_energy_counter(profiling):
    """On a GPU with NVML: BF16 GEMMs back to back for a second cost joules per call whose
    mean draw lies inside (0, 1.2 x the power limit], and a longer GEMM costs more per call. (A
    second, not half: an H100's energy counter refreshes every 120 ms, and a window must span three
    refreshes; the calibrated half second came out at 271 ms there.)"""
    import torch

    pytest.importorskip("pynvml", reason="NVML bindings not installed (pip install nvidia-ml-py)")
    t = profiling.nvml
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    res = t.energy_window(
        {"big": lambda i: a @ a, "small": lambda i: b @ b.t()[:, :4096]}, 1, "cuda", seconds=1.0, rounds=1
    )
    for name, e in res.items():
        assert e["j"] is not None, e["energy_reason"]
        limit = (e["gpu"] or {}).get("power_limit_w") or 1000.0
        assert 0 < e["w"] <= 1.2 * limit, (name, e)
    assert res["big"]["j"] > res["small"]["j"]


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_gemm_tflops_operands_compute_the_bf16_gemm(bench_modules, recipe, gemm):
    """The pre-quantised operands are laid out so that scaled_matmul computes the same GEMM as
    the BF16 torch.mm it is compared with (a wrong orientation would give an error of order 1)."""
    import torch

    from nemo_fp8_recipes.quant import scaled_matmul
    from nemo_fp8_recipes.recipes import get_recipe

    _, g, _ = bench_modules
    torch.manual_seed(0)
    m, n, k = 256, 384, 128
    x, w, dy = torch.randn(m, k), torch.randn(n, k) * 0.02, torch.randn(m, n) * 1e-3
    qa, qb, fast, out_dtype = g.fp8_operands(get_recipe(recipe), x, w, dy, gemm)
    got = scaled_matmul(qa, qb, emulate=True, out_dtype=torch.float32, fast_accum=fast)
    want = g.bf16_gemm(x, w, dy, gemm)
    assert got.shape == want.shape == g.gemm_shape(m, n, k, gemm)[:2]
    assert out_dtype == (torch.float32 if gemm == "wgrad" else torch.bfloat16)
    assert ((got - want).norm() / want.norm()).item() < 0.08


def test_benchmarks_refuse_to_time_without_fp8(bench_modules, capsys):
    """Outside --smoke a CPU or a GPU without FP8 is an error that says why; on an H200 mxfp8 is
    a skipped row carrying check_supported's reason, and the other recipes run for real."""
    from nemo_fp8_recipes.hardware import DeviceInfo

    t, g, layer = bench_modules
    a100 = DeviceInfo(type="cuda", name="NVIDIA A100", capability=(8, 0), cuda_version=(12, 4))
    with pytest.raises(SystemExit, match=r"tensorwise needs an FP8 GPU \(SM89 Ada, SM90 Hopper or newer\); found SM80"):
        t.benchmark_device(False, a100)
    for main in (g.main, layer.main):
        with pytest.raises(SystemExit, match="found no CUDA device. Run with --smoke"):
            main(["--sizes", "8b"])
    h200 = DeviceInfo(type="cuda", name="NVIDIA H200", capability=(9, 0), cuda_version=(13, 0))
    assert t.benchmark_device(False, h200) == "cuda"
    assert t.recipe_mode("mxfp8", h200) == (
        "skipped",
        "mxfp8 needs SM100 (Blackwell: B200/GB200); found SM90 (NVIDIA H200); use blockwise, "
        "or emulate=true for numerics only",
    )
    for r in ("tensorwise", "delayed", "blockwise"):
        assert t.recipe_mode(r, h200)[0] == "real"
    assert t.recipe_mode("tensorwise", "cpu")[0] == "emulated"


def test_layer_fwd_bwd_fused_projections_smoke(tmp_path):
    """``--projections separate,fused``: every variant of ours in both layouts (``+fused`` rows
    with ``wqkv`` / ``w13``: 4 FP8 linears instead of 7), each compared with the BF16 layer of its
    own layout; an unknown layout is refused with the valid ones."""
    data = _run_smoke(
        "layer_fwd_bwd.py",
        tmp_path,
        "--variants",
        "bf16,tensorwise",
        "--modes",
        "eager",
        "--projections",
        "separate,fused",
    )
    assert data["projections"] == ["separate", "fused"]
    rows = {r["variant"]: r for r in data["results"]}
    assert set(rows) == {"bf16", "tensorwise", "bf16+fused", "tensorwise+fused"}
    assert rows["tensorwise"]["fp8_linears"] == 7 and rows["tensorwise+fused"]["fp8_linears"] == 4
    assert rows["tensorwise+fused"]["projections"] == "fused" and rows["tensorwise"]["projections"] == "separate"
    assert rows["bf16+fused"]["speedup"] == 1.0  # its own BF16 baseline
    r = rows["tensorwise+fused"]
    assert r["speedup"] == pytest.approx(rows["bf16+fused"]["ms"] / r["ms"])
    proc, _ = _smoke("layer_fwd_bwd.py", tmp_path, "--projections", "merged")
    assert proc.returncode == 2 and "unknown projections 'merged'; valid: separate, fused" in proc.stderr


@pytest.mark.parametrize("projections", ["fused", "separate,fused"])
def test_layer_fwd_bwd_keeps_te_layer_once_for_any_projections(tmp_path, projections):
    """TE's layer has one layout (fused QKV and FC1): it is set up once whatever ``--projections``
    names, so a fused-only command still times ours against TE (a row that is skipped here, without
    TE, with the reason)."""
    data = _run_smoke(
        "layer_fwd_bwd.py",
        tmp_path,
        "--variants",
        "bf16,tensorwise,te-tensorwise",
        "--modes",
        "eager",
        "--projections",
        projections,
    )
    variants = [r["variant"] for r in data["results"]]
    assert variants.count("te-tensorwise") == 1, variants
    assert "tensorwise+fused" in variants
    (te,) = [r for r in data["results"] if r["variant"] == "te-tensorwise"]
    assert te["projections"] == "fused"


@pytest.mark.parametrize(
    "block,n_fp8,extra",
    [
        ("layer", 7, ("--peak-report",)),
        ("mlp", 3, ("--requant-weights", "--compile-mode", "reduce-overhead")),
        ("layer", 7, ("--rounds", "2", "--requant-weights", "--micro-batches", "2")),
    ],
    ids=["layer", "mlp-reduce-overhead", "layer-round-robin-micro-batches"],
)
def test_layer_fwd_bwd_smoke(tmp_path, block, n_fp8, extra):
    data = _run_smoke("layer_fwd_bwd.py", tmp_path, "--block", block, *extra)
    rounds = int(extra[extra.index("--rounds") + 1]) if "--rounds" in extra else 1
    assert data["rounds"] == rounds
    assert data["block"] == block and data["param_dtype"] == "fp32"
    assert data["requant_weights"] == ("--requant-weights" in extra)
    # --micro-batches 2: weights re-quantised every second step, the compiled ones read from their cache
    assert data["micro_batches"] == (2 if "--micro-batches" in extra else 1)
    # the allocator history is CUDA's: on CPU the option is accepted and reports nothing
    assert not any("peak_live" in r for r in data["results"])
    assert data["compile_mode"] == ("reduce-overhead" if "--compile-mode" in extra else None)
    rows = {(r["variant"], r["mode"]): r for r in data["results"]}
    variants = ("bf16", "tensorwise", "delayed", "blockwise", "torchao-tensorwise", "torchao-rowwise")
    assert set(rows) == {(v, m) for v in variants for m in ("eager", "compiled")}
    try:
        import torchao.float8  # noqa: F401

        have_torchao = True
    except ImportError:
        have_torchao = False
    for (variant, mode), r in rows.items():
        if variant.startswith("torchao") and not have_torchao:
            assert r["status"] == "skipped: torchao not installed" and r["ms"] is None
            continue
        assert r["status"] == "ok", r
        assert all(
            _finite_positive(r[k]) for k in ("ms", "tflops", "speedup", "first_call_s", "ms_b2b", "speedup_b2b")
        ), r
        # smoke: --iters 2, so 2 synchronised samples and 3 back-to-back windows, or with
        # --rounds 2 one and two of them per round
        assert r["rounds"] == rounds
        assert (r["samples"]["ms"], r["samples"]["ms_b2b"]) == ((2, 3) if rounds == 1 else (2, 4)), r
        # the same linears are FP8 in our recipes and in torchao's (the policy's choice)
        assert r["fp8_linears"] == (0 if variant == "bf16" else n_fp8)
        # compiled: our FP8 linears are traced (no graph break), delayed scaling too (the
        # benchmark runs the trainer's step schedule)
        if mode == "compiled":
            assert r["graph_breaks"] == 0, r
        else:
            assert r["graph_breaks"] is None
        if have_torchao:
            assert _finite_positive(r["vs_torchao_tensorwise"])
        else:
            assert r["vs_torchao_tensorwise"] is None
    assert rows[("bf16", "eager")]["speedup"] == 1.0 == rows[("bf16", "eager")]["speedup_b2b"]


def test_layer_round_robin_keeps_each_variants_compiled_graph(bench_modules, monkeypatch):
    """``--rounds`` keeps every variant compiled at once: ``isolate`` gives each its own forward
    code object (so its own dynamo cache), and called in turn, each within its settings as the
    rounds run them, every variant runs the graph traced with its own setting (one read while
    tracing, as a module's ``KernelOptions.triton`` is) — with no recompilation."""
    import os

    import torch
    import torch.nn as nn
    from torch._dynamo.testing import CompileCounter

    _, _, layer = bench_modules

    class Scale(nn.Module):
        def forward(self, x):
            return x * (2.0 if os.environ.get("NFR_TEST_TRACE_SETTING") == "a" else 3.0)

    torch._dynamo.reset()
    counter, fns = CompileCounter(), {}
    for tag in ("a", "b"):
        monkeypatch.setenv("NFR_TEST_TRACE_SETTING", tag)
        fns[tag] = torch.compile(layer.isolate(Scale(), f"v_{tag}"), backend=counter)
        fns[tag](torch.ones(2))  # traced with this setting
    codes = {tag: type(f._orig_mod).forward.__code__ for tag, f in fns.items()}
    assert codes["a"] is not codes["b"] and codes["a"].co_name == "forward_v_a"
    assert isinstance(fns["a"]._orig_mod, Scale) and counter.frame_count == 2
    for _ in range(2):  # alternated, as the rounds run them
        for tag, want in (("a", 2.0), ("b", 3.0)):
            monkeypatch.setenv("NFR_TEST_TRACE_SETTING", tag)
            assert fns[tag](torch.ones(2)).tolist() == [want, want]
    assert counter.frame_count == 2
    torch._dynamo.reset()


def test_bench_interleaved_isolates_a_failing_variant(bench_modules):
    """With ``errors`` given, a variant whose block raises (e.g. out of memory in round 2) is
    recorded there and left out; the others are timed in every round. Without it, the exception
    propagates. The per-variant contexts are entered around each block."""
    t, _, _ = bench_modules
    calls = {"ok": 0, "bad": 0}  # (calls made, for the record)
    entered = []

    def ok(i):
        calls["ok"] += 1

    def bad(i):  # fails in its second round
        calls["bad"] += 1
        if entered.count("bad") == 2:
            raise RuntimeError("CUDA out of memory (simulated)")

    import contextlib

    @contextlib.contextmanager
    def ctx(name):
        entered.append(name)
        yield

    fns = {"ok": ok, "bad": bad}
    errors = {}
    out = t.bench_interleaved(
        fns,
        2,
        "cpu",
        rounds=3,
        warmup=1,
        iters=3,
        window=2,
        b2b_warmup=1,
        contexts={k: (lambda k=k: ctx(k)) for k in fns},
        errors=errors,
    )
    assert set(out) == {"ok"} and set(errors) == {"bad"} and "out of memory" in str(errors["bad"])
    assert out["ok"]["samples"]["ms"] == 3 and entered.count("ok") == 3 and entered.count("bad") == 2
    entered.clear()
    with pytest.raises(RuntimeError, match="out of memory"):
        t.bench_interleaved(
            fns,
            2,
            "cpu",
            rounds=3,
            warmup=1,
            iters=3,
            window=2,
            b2b_warmup=1,
            contexts={k: (lambda k=k: ctx(k)) for k in fns},
        )


def test_layer_round_robin_refuses_cuda_graph_trees(bench_modules):
    _, _, layer = bench_modules
    with pytest.raises(SystemExit):
        layer.main(["--smoke", "--rounds", "2", "--compile-mode", "reduce-overhead"])
    with pytest.raises(SystemExit):
        layer.main(["--smoke", "--rounds", "0"])


def test_layer_cuda_graph_and_energy_rows(tmp_path):
    """``layer_fwd_bwd.py --cuda-graph --energy``: every row says whether its step was captured
    (on CPU: why not) and gets an energy record from its back-to-back window — the time and call
    count, with the reason the joules are missing off a GPU — round-robin as well; the energy
    table is printed; contradictory options are refused."""
    data = _run_smoke(
        "layer_fwd_bwd.py",
        tmp_path,
        "--block",
        "mlp",
        "--variants",
        "bf16,tensorwise,delayed",
        "--rounds",
        "2",
        "--micro-batches",
        "2",
        "--cuda-graph",
        "--energy",
        "0.02",
    )
    assert data["cuda_graph"] is True and data["energy_s"] == 0.02
    rows = {(r["variant"], r["mode"]): r for r in data["results"]}
    assert len(rows) == 6
    for (variant, mode), r in rows.items():
        assert r["status"] == "ok", r
        e = r["energy"]
        assert e["calls"] >= 3 and _finite_positive(e["ms"]), e
        if e["j"] is None:
            assert e["energy_reason"] and e["w"] is None and r["energy_vs_bf16"] is None
        else:
            assert math.isclose(e["w"], e["j"] / (e["ms"] / 1e3))
        if r["graph_status"] == "ok":  # (a GPU host)
            assert _finite_positive(r["ms_graph"]) and r["energy_graph"]["calls"] >= 3
            continue
        assert r["ms_graph"] is None and "energy_graph" not in r
        # two micro-batches per step: only the compiled weight cache is refreshed in place between
        # replays, so our eager rows and delayed scaling (no compiled weight cache) are not
        # captured, with the reason
        if variant != "bf16" and (mode == "eager" or variant == "delayed"):
            assert "only the compiled weight cache" in r["graph_status"], r
        else:
            assert r["graph_status"] == "not captured: no CUDA device", r
    for args, msg in (
        (["--energy", "-1"], "--energy is a duration"),
        (["--cuda-graph", "--compile-mode", "reduce-overhead"], "use one or the other"),
    ):
        bad = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "layer_fwd_bwd.py"), "--smoke", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode == 2 and msg in bad.stderr, bad.stderr[-500:]


@pytest.mark.gpu
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_layer_cuda_graph_replays_the_compiled_step(bench_modules, micro_batches):
    """``--cuda-graph``'s replays of a compiled tensorwise MLP step (two input sets: two graphs
    sharing one memory pool, replayed in turn with the step also called normally in between, as
    the round-robin timing runs them) give the gradients of the step called normally, bit for bit.
    A weight changed as an optimizer step changes it reaches the graphs: with one micro-batch per
    step at once (quantised in the graph), with two through the compiled weight cache, which the
    replay re-quantises in place before every second replay (and not in between)."""
    import argparse

    import torch

    from nemo_fp8_recipes.models import load_model_config

    _, _, layer = bench_modules
    cfg = load_model_config("llama3_8b").replace(
        name="tiny", dim=512, num_heads=4, num_kv_heads=2, ffn_dim=1024, max_seq_len=256
    )
    a = argparse.Namespace(
        seq=256,
        batch=2,
        input_sets=2,
        micro_batches=micro_batches,
        requant_weights=True,
        compile_backend="inductor",
        compile_mode=None,
        cuda_graph=True,
    )
    torch._dynamo.reset()
    inputs = layer.Inputs(cfg, a, "cuda", torch.float32, torch.float32)
    model = layer.build(cfg, "mlp", "tensorwise", "cuda", smoke=False)
    step, out = layer.prepare(model, "compiled", inputs, a, "cuda")
    assert step is not None, out
    row = {}
    replay = layer.graph_step(step, model, "compiled", inputs, a, row)
    assert row["graph_status"] == "ok" and replay is not None, row
    params = [q for q in model.parameters() if q.requires_grad]
    x1 = inputs.xs[1]
    # the last captured graph's (input set 1's) own output tensors; set 0's graph wrote its
    # gradients into the shared pool, where set 1's graph may reuse that memory
    graph_out = [q.grad for q in params] + [x1.grad]

    def replayed_1():
        replay(1)
        torch.cuda.synchronize()
        return [t.clone() for t in graph_out]

    def stepped(i):
        step(i, refresh=False)
        torch.cuda.synchronize()
        return [q.grad.clone() for q in params] + [inputs.xs[i].grad.clone()]

    def diff(u, v):
        return [(t - w).abs().max().item() for t, w in zip(u, v)]

    zero = [0.0] * (len(params) + 1)
    fp8 = [m for m in model.modules() if type(m) is layer.Float8Linear]
    assert len(fp8) == 3

    def scale_weights(f):  # what an optimizer step does to the weights (a new version)
        with torch.no_grad():
            for q in params:
                q.mul_(f)

    replay(0)  # replay call 0: the first micro-batch of a step (K = 2: the cache re-quantised first)
    stepped(0)
    r0 = replayed_1()  # call 1
    assert diff(r0, stepped(1)) == zero
    scale_weights(1.5)
    replay(0)  # call 2: a new optimizer step
    stepped(0)
    if micro_batches > 1:  # changed inside the step: not seen until the next step's refresh
        scale_weights(2.0)
        assert all(m.graph_weight_cache_stale() for m in fp8)
    r1 = replayed_1()  # call 3
    assert min(diff(r1, r0)) > 0
    assert diff(r1, stepped(1)) == zero
    if micro_batches > 1:
        replay(0)  # call 4: the next step, refreshed from the doubled weights
        r2 = replayed_1()
        assert min(diff(r2, r1)) > 0 and diff(r2, stepped(1)) == zero
        assert not any(m.graph_weight_cache_stale() for m in fp8)
    torch._dynamo.reset()


def test_layer_policy_filter_matches_convert_model(bench_modules):
    """torchao is handed exactly the linears convert_model puts in FP8."""
    import torch.nn as nn

    from nemo_fp8_recipes.models import load_model_config
    from nemo_fp8_recipes.policy import PrecisionPolicy

    _, _, layer = bench_modules
    cfg = load_model_config("llama3_8b").replace(dim=128, num_heads=2, num_kv_heads=1, ffn_dim=256, max_seq_len=16)
    ours = layer.build(cfg, "layer", "tensorwise", "cpu", smoke=True)
    fp8 = {n for n, m in ours.named_modules() if type(m).__name__ == "Float8Linear"}
    plain = layer.OneLayer(cfg, "layer")
    keep = layer.policy_filter(PrecisionPolicy())
    chosen = {n for n, m in plain.named_modules() if isinstance(m, nn.Linear) and keep(m, n)}
    assert chosen == fp8 and len(fp8) == 7
    assert "layers.0.attention.wq" in fp8 and "layers.0.feed_forward.w2" in fp8


def test_gemm_tflops_skipped_and_failed_variants_are_rows(bench_modules, monkeypatch, tmp_path, capsys):
    """A recipe the GPU lacks is a row carrying check_supported's reason, and a variant that
    raises is an error row (the other variants are still measured; exit status 1)."""
    _, g, _ = bench_modules
    reason = (
        "mxfp8 needs SM100 (Blackwell: B200/GB200); found SM90 (NVIDIA H200); use blockwise, or emulate=true "
        "for numerics only"
    )
    real_mode = g.recipe_mode
    monkeypatch.setattr(g, "recipe_mode", lambda r, d: ("skipped", reason) if r == "mxfp8" else real_mode(r, d))
    real_mm = g.scaled_matmul

    def failing(qa, qb, **kw):
        if qa.block == (1, 128):
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        return real_mm(qa, qb, **kw)

    monkeypatch.setattr(g, "scaled_matmul", failing)
    out = tmp_path / "g.json"
    assert g.main(["--smoke", "--out", str(out)]) == 1
    rows = json.loads(out.read_text())["results"]
    assert [r["status"] for r in rows if r["variant"] == "mxfp8"] == [f"skipped: {reason}"]
    blk = [r for r in rows if r["variant"] == "blockwise"]
    assert len(blk) == 6 and all(r["status"] == "error: RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED" for r in blk)
    assert all(r["status"] == "ok" for r in rows if r["variant"] in ("bf16", "per-tensor"))
    printed = capsys.readouterr().out
    assert f"skipped: {reason}" in printed and "CUBLAS_STATUS_NOT_SUPPORTED" in printed


@pytest.mark.parametrize(
    "block, variant, reason",
    [
        ("mlp", "delayed-unfused-swiglu", "skipped: the SwiGLU fusion is eager-only"),
        ("layer", "tensorwise-unshared-input", "skipped: the shared input quantisation is eager-only"),
        ("layer", "bf16-unfused-norm", "skipped: the fused RMSNorm is eager-only"),
    ],
)
def test_layer_eager_only_variants(tmp_path, block, variant, reason):
    """The eager-only A/B variants (``*-unfused-swiglu``: the fused SwiGLU turned off;
    ``tensorwise-unshared-input``: ``shared_input=False``; ``*-unfused-norm``: ``fused_norm=False``):
    measured eager, reported as skipped
    compiled with the reason (the compiled path is the recipe's own there)."""
    proc, data = _smoke("layer_fwd_bwd.py", tmp_path, "--block", block, "--variants", f"bf16,{variant}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {(r["variant"], r["mode"]): r for r in data["results"]}
    assert rows[(variant, "eager")]["status"] == "ok"
    assert rows[(variant, "eager")]["ms"] > 0
    skipped = rows[(variant, "compiled")]
    assert skipped["status"].startswith(reason) and skipped["ms"] is None


def test_gpu_monitor_says_why_it_has_no_readings(bench_modules, profiling):
    """Without a CUDA device the monitor records nothing and says so; the table cell is ``-``."""
    t = bench_modules[0]
    with profiling.nvml.GpuMonitor("cpu") as mon:
        sum(range(1000))
    assert mon.summary() is None and mon.reason == "no CUDA device"
    assert t.gpu_cell(mon.summary()) == "-"
    cell = t.gpu_cell({"sm_mhz_median": 1755.0, "power_w_mean": 699.6, "clock_reasons": ["sw-power-cap"]})
    assert cell == "1755 MHz, 700 W (sw-power-cap)"
    # a metric the device does not report is left out, not shown as a number
    assert t.gpu_cell({"sm_mhz_median": 1500.0, "power_w_mean": None, "clock_reasons": []}) == "1500 MHz"


@pytest.mark.gpu
def test_gpu_monitor_samples_clock_and_power_while_the_gpu_works(profiling):
    """On a GPU with NVML: samples taken during a second of GEMMs give a running SM clock, a power
    draw inside (0, limit], a temperature; the reasons list only known names."""
    import torch

    pytest.importorskip("pynvml", reason="NVML bindings not installed (pip install nvidia-ml-py)")
    t = profiling.nvml
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with t.GpuMonitor("cuda", interval=0.005) as mon:
        for _ in range(100):
            a @ a
        torch.cuda.synchronize()
    s = mon.summary()
    assert s is not None, mon.reason
    assert s["samples"] >= 5 and 300 <= s["sm_mhz_min"] <= s["sm_mhz_median"] <= 4000
    assert 0 < s["power_w_mean"] <= s["power_w_max"] <= 1.2 * s["power_limit_w"]
    assert 0 < s["temp_c_max"] < 110
    assert set(s["clock_reasons"]) <= set(t._CLOCK_REASONS.values())


def test_host_profile_smoke(tmp_path):
    """``profiling/host_profile.py --smoke``: a host time and a per-step profile for every recipe
    asked for; an unknown recipe is refused with the valid ones."""
    data = _run_smoke("profiling/host_profile.py", tmp_path, "--recipes", "tensorwise,blockwise", "--top", "5")
    assert [r["recipe"] for r in data["results"]] == ["tensorwise", "blockwise"]
    for r in data["results"]:
        assert r["host_us_per_step"] > 0 and len(r["top_own_time"]) == 5
        assert all(t["us_per_step"] >= 0 and t["calls_per_step"] > 0 for t in r["top_own_time"])
    bad = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "profiling" / "host_profile.py"), "--smoke", "--recipes", "bf16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "valid: delayed, tensorwise, blockwise, mxfp8" in bad.stderr


def test_layer_benchmark_te_variants_say_why_they_did_not_run(tmp_path):
    """The te.TransformerLayer rows are in the table on every machine: timed where Transformer
    Engine runs, skipped with the reason elsewhere (here: not importable, or no GPU)."""
    proc, data = _smoke(
        "layer_fwd_bwd.py",
        tmp_path,
        "--block",
        "mlp",
        "--variants",
        "bf16,te-bf16,te-tensorwise,te-blockwise,te-delayed",
        "--modes",
        "eager,compiled",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {(r["variant"], r["mode"]): r for r in data["results"]}
    for v in ("te-bf16", "te-tensorwise", "te-blockwise", "te-delayed"):
        for m in ("eager", "compiled"):
            st = rows[(v, m)]["status"]
            assert st.startswith("skipped: ") and ("Transformer Engine" in st or "te.TransformerLayer" in st), st
    assert rows[("bf16", "eager")]["status"] == "ok"


def _train_throughput(tmp_path, *args: str, timeout: int):
    """:func:`_smoke` of ``train_throughput.py`` with its runs under ``tmp_path``, in a folder whose
    name Hydra would misread unquoted (a comma is a sweep, ``=`` an override, brackets a list)."""
    root = tmp_path / "runs,a b=[c]"
    return _smoke("train_throughput.py", tmp_path, *args, "--root", str(root), timeout=timeout, cwd=ROOT)


def test_train_throughput_with_the_megatron_te_column(tmp_path):
    """``train_throughput.py --megatron-te``: the embedded trainer's rows and, beside them, one
    Megatron-Core + TE row per recipe and main-gradient precision (``--megatron-main-grads``) —
    trained where TE runs (FP32 main grads with ``--grad-reduce-in-fp32``), skipped with the reason
    here."""
    proc, data = _train_throughput(
        tmp_path, "--recipes", "bf16,tensorwise", "--megatron-te", "--megatron-main-grads", "bf16,fp32", timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["recipe"] for r in data["results"]] == ["bf16", "tensorwise"]
    assert all(r["returncode"] == 0 and r["tokens_per_s"] for r in data["results"])
    te = {(r["recipe"], r["main_grad"]): r for r in data["megatron_te"]}
    assert set(te) == {(k, g) for k in ("bf16", "tensorwise") for g in ("bf16", "fp32")}
    from nemo_fp8_recipes.integrations.te import te_available

    if not te_available()[0]:
        assert all(r["status"].startswith("skipped: Transformer Engine not importable") for r in te.values())
    else:
        for (k, g), r in te.items():
            assert r["status"] == "ok" and r["tokens_per_s"] > 0, r
            assert ("--grad-reduce-in-fp32" in r["cmd"]) == (g == "fp32")
    assert "Megatron-Core + TE main grads" in proc.stdout


def test_train_throughput_refuses_an_unknown_main_grad_precision(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "--megatron-main-grads", "fp16"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "unknown --megatron-main-grads fp16; valid: bf16, fp32" in proc.stderr


def test_train_throughput_bridge_rows_run_our_launcher_with_bridges_perf_settings(tmp_path):
    """``train_throughput.py --bridge``: one run of our Megatron-Bridge launcher per Hopper recipe
    under ``torchrun``, with ``backend.perf=llama3_8b_h100`` and the trainer's shapes; where Bridge
    cannot be imported (here) the row fails with the launcher's reason and the sweep says so."""
    proc, data = _train_throughput(
        tmp_path, "--smoke", "--recipes", "bf16,mxfp8", "--backends", "", "--bridge", timeout=300
    )
    assert proc.returncode == 1 and data["results"] == []
    (row,) = data["bridge"]  # mxfp8: no Hopper GEMMs in TE, left out
    assert row["recipe"] == "bf16" and not row["ok"] and row["status"] == "failed"
    for arg in ("backend.perf=llama3_8b_h100", "backend.provider=ours", "model.num_layers=1", "trainer.seq_len=64"):
        assert arg in row["cmd"].split()
    assert "needs Megatron-Bridge" in row["error"] and "Megatron-Bridge tok/s" in proc.stdout
    # the run's whole output is kept beside the rows, and its iteration times (none here)
    assert "needs Megatron-Bridge" in Path(row["log"]).read_text() and row["iteration_ms"] == []
    assert row["fp8_param_gather"] is None and not any("fp8_param_gather" in a for a in row["cmd"].split())
    # FP8 primary weights off for every FP8 recipe, against Bridge's preset (on for tensorwise)
    _, data = _train_throughput(
        tmp_path, "--smoke", "--recipes", "tensorwise", "--backends", "", "--bridge",
        "--bridge-fp8-param-gather", "false", timeout=300,
    )  # fmt: skip
    (row,) = data["bridge"]
    assert row["fp8_param_gather"] == "false" and "backend.fp8_param_gather=false" in row["cmd"].split()
    assert "needs Megatron-Bridge" in row["error"]  # the launcher took the override; only Bridge is missing here


def test_bridge_log_lines_are_read_as_bridge_writes_them(tmp_path):
    """The iteration line of Megatron-Bridge 0.6.2's ``training_log`` (its format strings), with and
    without the throughput and loss fields."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import train_throughput as tt
    finally:
        sys.path.pop(0)
    line = " [2026-12-06 21:00:00]" + " iteration {:8d}/{:8d} |".format(12, 40)
    line += " consumed samples: {:12d} |".format(48) + " elapsed time per iteration (ms): {:.1f} |".format(565.25)
    full = (
        line
        + f" throughput per GPU (TFLOP/s/GPU): {402.14:.1f} |"
        + " learning rate: 2.9E-04 | lm loss: 1.052345E+01 |"
    )
    assert tt.parse_bridge_log(full + "\n" + line + "\n") == [(12, 565.2, 402.1, 10.52345), (12, 565.2, None, None)]
    assert tt.parse_bridge_log("iteration 3 done\n") == []


def test_train_throughput_graphs_mode_is_refused_on_cpu_with_the_reason(tmp_path):
    """``train_throughput.py --compile graphs`` runs the trainer with
    ``trainer.compile_mode=reduce-overhead``; on CPU the trainer refuses it and the row says why;
    an unknown mode lists the valid ones."""
    proc, data = _train_throughput(tmp_path, "--recipes", "bf16", "--compile", "graphs", timeout=300)
    assert proc.returncode == 1
    (row,) = data["results"]
    assert row["mode"] == "graphs" and "trainer.compile_mode=reduce-overhead" in row["cmd"]
    assert (
        "compile_mode=reduce-overhead replays the compiled graphs as CUDA graphs and needs a CUDA device"
        in row["error"]
    )
    proc, _ = _train_throughput(tmp_path, "--recipes", "bf16", "--compile", "fast", timeout=120)
    assert proc.returncode == 2 and "unknown --compile mode 'fast'; valid: eager, compiled, graphs, both" in proc.stderr


def test_train_throughput_measures_the_cost_of_deterministic_mode(tmp_path):
    """``train_throughput.py --deterministic both``: each recipe runs without and then with
    ``trainer.deterministic=true`` (each run's config says which), and the cost table pairs them."""
    proc, res = _train_throughput(tmp_path, "--recipes", "bf16", "--deterministic", "both", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = res["results"]
    assert [r["deterministic"] for r in runs] == [False, True]
    for r in runs:
        assert f"trainer.deterministic={str(r['deterministic']).lower()}" in r["cmd"]
        cfg = (Path(r["run_dir"]) / "config.yaml").read_text()
        assert f"deterministic: {str(r['deterministic']).lower()}" in cfg
    assert runs[0]["run_dir"] != runs[1]["run_dir"]
    (row,) = res["deterministic_cost"]
    assert row["recipe"] == "bf16" and row["mode"] == "eager"
    assert row["deterministic_over_default"] == pytest.approx(runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"])
    assert "| native | bf16 | eager | 1 |" in proc.stdout and "deterministic / default" in proc.stdout


def test_layer_speedup_plot_reads_the_measured_te_columns(tmp_path):
    """``plot_layer_speedup.py`` on the layer results the docs link: ours and TE's speed-up over
    our compiled BF16 layer per recipe and size (values from the run's own ``speedup`` field)."""
    src = ROOT / "docs" / "results" / "layer_te_h200_2026-12-02.json"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from plot_layer_speedup import rows_of, speedups
    finally:
        sys.path.pop(0)
    data = json.loads(src.read_text())
    sp = speedups(rows_of(data))
    want = {
        r["size"]: r["speedup"]
        for run in data["runs"]
        for r in run["results"]
        if r["variant"] == "te-tensorwise" and r["mode"] == "compiled"
    }
    assert sp[("te", "tensorwise")] == want and set(want) == {"8b", "70b", "405b"}
    assert set(sp[("ours", "blockwise")]) == {"8b", "70b", "405b"}
    assert all(v == 1.0 for v in sp[("ours", "bf16")].values())  # (the baseline itself)
    h100 = json.loads((ROOT / "docs" / "results" / "layer_te_torchao_h100_2026-12-05.json").read_text())
    sp = speedups(rows_of(h100))  # (torchao's rows: dotted lines of their own recipe names)
    assert set(sp[("torchao", "tensorwise")]) == set(sp[("torchao", "rowwise")]) == {"8b", "70b", "405b"}
    assert ("ours", "torchao-tensorwise") not in sp and set(sp[("te", "delayed")]) == {"8b", "70b", "405b"}
    png = tmp_path / "speedup.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plot_layer_speedup.py"), str(src), "--out", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_layer_benchmark_names_the_cudnn_fix_when_torch_cannot_load_its_own(monkeypatch):
    """A system cuDNN older than PyTorch's, first on the library path, makes PyTorch disable cuDNN
    (its SDPA then runs other attention kernels than TE's layer): the layer benchmark says so and
    how to give PyTorch its own cuDNN, instead of timing different attention."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import layer_fwd_bwd
    finally:
        sys.path.pop(0)

    def broken():
        raise RuntimeError(
            "cuDNN version incompatibility: PyTorch was compiled  against (9, 19, 0) but found "
            "runtime version (9, 14, 0).\nmore"
        )

    monkeypatch.setattr(torch.backends.cudnn, "version", broken)
    v, why = layer_fwd_bwd.cudnn_status()
    assert v is None
    assert why.startswith(
        "PyTorch cannot use cuDNN here (cuDNN version incompatibility: PyTorch was compiled  "
        "against (9, 19, 0) but found runtime version (9, 14, 0).)"
    )
    assert "cuDNN attention" in why and ("LD_LIBRARY_PATH" in why)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    assert layer_fwd_bwd.cudnn_status() == ("9.19.0", None)


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_moe_fwd_bwd_smoke(tmp_path, routing):
    """``moe_fwd_bwd.py --smoke``: every variant that runs on a CPU is timed and its output checked
    against the FP32 experts (BF16 within 1%, the emulated FP8 recipes within 10%); torchao's and
    TE's rows say why they were skipped where those are missing."""
    data = _run_smoke("moe_fwd_bwd.py", tmp_path, "--routing", routing)
    h = data["header"]
    assert sum(h["sizes"]) == h["rows"] == h["tokens"] * h["top_k"] and all(s % 16 == 0 for s in h["sizes"])
    rows = {r["variant"]: r for r in data["results"]}
    for name in ("bf16-grouped-mm", "bf16-loop", "tensorwise", "blockwise", "delayed", "mxfp8"):
        r = rows[name]
        assert r["status"] == "ok" and _finite_positive(r["ms"]) and _finite_positive(r["tflops"]), r
        assert r["rel_err"] < (0.01 if name.startswith("bf16") else 0.10), r
    base_ms = rows["bf16-grouped-mm"]["ms"]
    for name in ("bf16-grouped-mm", "bf16-loop", "tensorwise", "blockwise", "delayed", "mxfp8"):
        assert rows[name]["vs_bf16"] == pytest.approx(base_ms / rows[name]["ms"], rel=1e-6), rows[name]
    for name in ("torchao-rowwise", "te-bf16", "te-tensorwise", "te-delayed", "te-blockwise"):
        assert rows[name]["status"].startswith("skipped: "), rows[name]


def test_moe_expert_sizes_are_multiples_of_16_that_sum_to_the_rows(bench_modules):
    import moe_fwd_bwd

    assert moe_fwd_bwd.expert_sizes(16384, 8, "balanced") == [2048] * 8
    for seed in range(5):
        sizes = moe_fwd_bwd.expert_sizes(16384, 8, "skewed", seed)
        assert sum(sizes) == 16384 and all(s % 16 == 0 and s >= 0 for s in sizes) and len(set(sizes)) > 1
    with pytest.raises(SystemExit, match="multiple of 16"):
        moe_fwd_bwd.expert_sizes(100, 8, "balanced")
