"""What the GPU ran at while a benchmark measured: NVML samples of the SM clock, power draw,
temperature and clock-event reasons (:class:`GpuMonitor`, for ``bench_interleaved(monitor=...)``
on a GPU), and the energy per call from the board's energy counter (:func:`energy_window`,
``--energy``). NVML comes from ``nvidia-ml-py`` (imported when a monitor opens); without it, or
without a GPU, every reading is None with the reason."""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from typing import Callable, ContextManager, Dict, List, Optional, Tuple

from _timing import bench_samples

#: NVML clock-event ("throttle") reason bits worth reporting next to a timing
_CLOCK_REASONS = {
    0x4: "sw-power-cap",
    0x8: "hw-slowdown",
    0x20: "sw-thermal",
    0x40: "hw-thermal",
    0x80: "hw-power-brake",
}


class GpuMonitor:
    """What the GPU ran at while a measurement ran: NVML samples of the SM clock, the power draw,
    the temperature and the clock-event reasons (power cap, thermal slowdown), taken every
    ``interval`` seconds in a background thread during the ``with`` block::

        with GpuMonitor("cuda") as mon:
            ms = bench(step, 3)
        mon.summary()  # {"sm_mhz_median": 1980, "power_w_mean": 612.0, ...} or None

    Samples accumulate over every ``with`` block of one monitor (``bench_interleaved`` enters
    one per variant in every round), so ``summary()`` covers all of them.

    ``summary()`` is None without a CUDA device or without NVML (``pip install nvidia-ml-py``;
    the GPU drivers ship the library); ``reason`` then says why. A metric the device does not
    report (e.g. power on some virtual GPUs) is None in the summary and named in ``reason``;
    the others are still sampled. The device is found by its UUID, so ``CUDA_VISIBLE_DEVICES``
    renumbering cannot make it read another GPU (by index only when nothing renumbers them).
    Power is NVML's reading, which the driver averages over a short window (about a second on
    recent GPUs), so runs shorter than that mostly show the draw before them."""

    _METRICS = ("sm_mhz", "power_w", "temp_c", "reasons")

    def __init__(self, device="cuda", interval: float = 0.02) -> None:
        self.device, self.interval = device, interval
        self.samples: List[dict] = []
        self.reason: Optional[str] = None
        self.power_limit_w: Optional[float] = None
        self._nvml = self._handle = self._thread = self._stop = None

    def _note(self, msg: str) -> None:
        self.reason = msg if not self.reason else f"{self.reason}; {msg}"

    def _open(self) -> None:
        import torch

        if str(self.device).split(":")[0] != "cuda" or not torch.cuda.is_available():
            self.reason = "no CUDA device"
            return
        try:
            import pynvml
        except ImportError:
            self.reason = "NVML bindings not installed (pip install nvidia-ml-py)"
            return
        try:
            pynvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - no driver library: say why, time anyway
            self.reason = f"NVML: {type(e).__name__}: {e}"
            return
        self._nvml = pynvml
        idx = torch.device(self.device).index
        idx = torch.cuda.current_device() if idx is None else idx
        uuid = str(getattr(torch.cuda.get_device_properties(idx), "uuid", "") or "")
        try:
            if not uuid:
                raise LookupError("this torch reports no device UUID")
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(
                uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
            )
        except Exception as e:  # noqa: BLE001
            if os.environ.get("CUDA_VISIBLE_DEVICES") is None:  # torch's index is NVML's
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(idx)
            else:
                self._note(
                    f"NVML: device {idx} not found by UUID ({type(e).__name__}: {e}) and "
                    "CUDA_VISIBLE_DEVICES renumbers devices: not sampled"
                )
                self._close()
                return
        try:
            self.power_limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1e3
        except Exception as e:  # noqa: BLE001 - e.g. not supported on this device
            self._note(f"NVML power limit: {type(e).__name__}")

    def _close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down: nothing to do about it
                pass
        self._nvml = self._handle = None

    def _sample(self) -> None:
        nv, h = self._nvml, self._handle
        get_reasons = getattr(
            nv, "nvmlDeviceGetCurrentClocksEventReasons", getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        )
        reads = {
            "sm_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
            "power_w": lambda: nv.nvmlDeviceGetPowerUsage(h) / 1e3,
            "temp_c": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            "reasons": lambda: get_reasons(h),
        }
        while not self._stop.is_set():
            sample = {}
            for name, read in list(reads.items()):
                try:
                    sample[name] = read()
                except Exception as e:  # noqa: BLE001 - drop this metric, keep the others
                    self._note(f"NVML {name}: {type(e).__name__}")
                    del reads[name]
            if not reads:
                return
            self.samples.append(sample)
            self._stop.wait(self.interval)

    def __enter__(self) -> "GpuMonitor":
        import threading

        self.reason = None
        self._open()
        if self._handle is not None:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5.0)  # a hung driver call must not hang the benchmark
            if self._thread.is_alive():
                self._note("NVML sampler did not stop within 5 s")
            self._thread = None
        self._close()

    def energy_mj(self) -> Optional[int]:
        """The board's energy counter (millijoules since the driver loaded; NVML's
        ``nvmlDeviceGetTotalEnergyConsumption``, Volta and later), or None — with the reason noted
        — without NVML, a device or the counter. Read it inside the ``with`` block."""
        if self._handle is None:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception as e:  # noqa: BLE001 - e.g. not supported on this device
            self._note(f"NVML energy counter: {type(e).__name__}")
            return None

    def summary(self) -> Optional[dict]:
        """Median / minimum SM clock (MHz), mean / maximum power (W) and the enforced limit,
        maximum temperature (°C), the clock-event reasons seen in any sample, the sample count;
        None for a metric that was not read."""
        if not self.samples:
            return None

        def col(name):
            return [x[name] for x in self.samples if name in x]

        clk, pw, temp, bits = (col(m) for m in self._METRICS)
        seen = 0
        for b in bits:
            seen |= b
        return {
            "sm_mhz_median": statistics.median(clk) if clk else None,
            "sm_mhz_min": min(clk, default=None),
            "power_w_mean": statistics.fmean(pw) if pw else None,
            "power_w_max": max(pw, default=None),
            "power_limit_w": self.power_limit_w,
            "temp_c_max": max(temp, default=None),
            "clock_reasons": [n for bit, n in _CLOCK_REASONS.items() if seen & bit],
            "samples": len(self.samples),
        }


def energy_window(
    fns: Dict[str, Callable[[int], object]],
    n_inputs: int,
    device,
    *,
    seconds: float,
    rounds: int = 2,
    contexts: Optional[Dict[str, Callable[[], ContextManager]]] = None,
    group: int = 1,
) -> Dict[str, dict]:
    """Energy per call of each variant at the GPU's sustained draw: each variant in turn
    (``rounds`` round-robin passes) runs back to back for about ``seconds`` (the call count from a
    3-call calibration), between two refreshes of the board's energy counter, less the idle
    draw after the work (:func:`_energy_of`), and two CUDA events. Returns per variant
    ``{"ms", "j", "w", "gpu", "energy_reason", "calls", "idle_w", "counter_wait_ms"}`` (the
    last two per window): the medians over the rounds of the time and the joules per
    call, their ratio (the mean draw, W), the last window's :meth:`GpuMonitor.summary`, and why
    ``j``/``w`` are None where the counter could not be read (on CPU: the host's time only).
    Under a power cap the throughput a kernel reaches is ``cap / (joules per FLOP)``: this is the
    measurement that says what a kernel costs once every variant runs at the cap. ``contexts``:
    per variant, a context manager entered around each of its windows and its calibration
    (``bench_interleaved``'s); ``group``: the call count is a multiple of it (whole cycles,
    as there)."""
    cuda = str(device).startswith("cuda")
    samples = {k: {"ms": [], "j": []} for k in fns}
    out: Dict[str, dict] = {}
    contexts = contexts or {}
    for _ in range(max(1, rounds)):
        for name, fn in fns.items():
            with contexts.get(name, contextlib.nullcontext)():
                # warm, and calibrate the call count: 3 warm-up calls, then one window of 3
                call_ms = bench_samples(fn, n_inputs, warmup=3, iters=1, cuda=cuda, window=3)[0]
                calls = max(3, math.ceil(seconds * 1e3 / max(call_ms, 1e-3)))
                calls = math.ceil(calls / max(1, group)) * max(1, group)
                with GpuMonitor(device) as mon:  # (the GPU idle: the calibration synchronised)
                    ms, joules, extra = _energy_of(
                        mon, lambda: bench_samples(fn, n_inputs, warmup=0, iters=1, cuda=cuda, window=calls)[0]
                    )
            samples[name]["ms"].append(ms)
            if joules is not None:
                samples[name]["j"].append(joules / calls)
                samples[name].setdefault("idle", []).append(extra)
            out[name] = {
                "gpu": mon.summary(),
                "calls": calls,
                "idle_w": [x["idle_w"] for x in samples[name].get("idle", [])],
                "counter_wait_ms": [x["counter_wait_ms"] for x in samples[name].get("idle", [])],
                "energy_reason": None if samples[name]["j"] else (mon.reason or "energy counter did not advance"),
            }
    for name, s in samples.items():
        ms = statistics.median(s["ms"])
        j = statistics.median(s["j"]) if s["j"] else None
        out[name].update(ms=ms, j=j, w=None if j is None else j / (ms / 1e3))
    return out


def _energy_tick(mon: "GpuMonitor", timeout_s: float = 0.5) -> Tuple[Optional[int], Optional[float], float]:
    """The board's energy counter read as soon as it next advances: ``(mJ, when (perf_counter
    s), ms waited)``. The driver refreshes the counter periodically (every 100 ms on the H200:
    docs/results/nvml_energy_tick_h200_2026-12-01), not at every read, so a read right after the GPU's work
    ends can miss up to one refresh interval of it — several per cent of a 2 s window at 700 W.
    mJ is None without the counter, or when it did not advance within ``timeout_s`` (noted in
    ``mon.reason``: a read that is not at a refresh would be off by up to an interval)."""
    e = mon.energy_mj()
    t0 = time.perf_counter()
    if e is None:
        return None, None, 0.0
    while True:
        e2 = mon.energy_mj()
        now = time.perf_counter()
        if e2 is None:
            return None, None, 0.0
        if e2 != e:
            return e2, now, (now - t0) * 1e3
        if now - t0 > timeout_s:
            mon._note(f"the energy counter did not advance within {timeout_s:g} s")
            return None, None, 0.0


def _energy_of(mon: "GpuMonitor", run: Callable[[], float]) -> Tuple[float, Optional[float], Optional[dict]]:
    """``run()``'s result (its ms) and the joules the board drew for it: between two counter
    refreshes (:func:`_energy_tick`) — one just before the work starts, one just after it ends —
    less the idle draw over the wait for the second (measured over one refresh interval of the
    idle GPU right before). Also ``{"idle_w", "counter_wait_ms"}``."""
    ea, ta, _ = _energy_tick(mon)
    e0, t0, _ = _energy_tick(mon) if ea is not None else (None, None, 0.0)
    ms = run()
    if e0 is None or ea is None:
        return ms, None, None
    e1, t1, wait_ms = _energy_tick(mon)
    if e1 is None:
        return ms, None, None
    interval = t0 - ta
    idle_w = (e0 - ea) / 1e3 / interval
    joules = (e1 - e0) / 1e3 - idle_w * wait_ms / 1e3
    if t1 - t0 < 3 * interval or joules <= 0:  # (refresh-sized errors would dominate)
        mon._note(
            f"window of {(t1 - t0) * 1e3:.0f} ms is under three refreshes of the energy counter "
            f"({interval * 1e3:.0f} ms each): too short to read"
        )
        return ms, None, None
    return ms, joules, {"idle_w": idle_w, "counter_wait_ms": wait_ms}
