"""The benchmarks' timing helper: CUDA events (``perf_counter`` on CPU), warm-up, medians over
rotating inputs, round-robin passes over several variants, CUDA-graph replays, host time per
call; and the small pieces every benchmark shares (Markdown tables, JSON output, the device
checks each FP8 benchmark makes before it measures).

Profiling tools (kernel breakdowns, GPU timelines, allocator traces, the NVML clock/power and
energy monitor) live in the optional :mod:`profiling` package next to this file, imported only
by the options that use them."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import statistics
import time
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Tuple


def bench(
    fn: Callable[[int], object],
    n_inputs: int,
    warmup: int = 5,
    iters: int = 30,
    cuda: Optional[bool] = None,
    window: int = 1,
) -> float:
    """Median milliseconds per call of ``fn(i)`` (``i`` cycles over ``n_inputs`` rotating input
    sets so the L2 cache does not serve repeated reads). CUDA events on GPU, perf_counter on CPU;
    ``cuda`` forces one or the other (default: CUDA events when CUDA is available).

    Each of the ``iters`` samples times ``window`` calls and synchronises once. ``window=1``
    synchronises after every call, so each call also pays the host's latency before its first
    kernel; ``window > 1`` ("back to back") queues the calls as a training loop that does not
    wait on the GPU every step runs them: the host prepares call ``i + 1`` while the GPU still
    runs call ``i``."""
    return statistics.median(bench_samples(fn, n_inputs, warmup, iters, cuda, window))


def bench_samples(
    fn: Callable[[int], object],
    n_inputs: int,
    warmup: int = 5,
    iters: int = 30,
    cuda: Optional[bool] = None,
    window: int = 1,
    start: int = 0,
    sync_each: bool = False,
) -> List[float]:
    """The ``iters`` per-call samples (ms) that :func:`bench` takes the median of; the inputs
    cycle from set ``start``. ``sync_each``: the ``window`` calls of a sample each wait for the
    GPU (a synchronisation after every call, inside the timed sample) instead of being queued
    back to back — the synchronised per-call time averaged over ``window`` calls, e.g. over the
    micro-batches of one optimizer step whose first call does more work than the others."""
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    for i in range(warmup):
        fn((start + i) % n_inputs)
    if cuda:
        torch.cuda.synchronize()
    times: List[float] = []
    k = start
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        for j in range(window):
            fn(k % n_inputs)
            k += 1
            if sync_each and cuda and j < window - 1:  # (the last call waits at the end event)
                torch.cuda.synchronize()
        if cuda:
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / window)
        else:
            times.append((time.perf_counter() - t0) * 1e3 / window)
    return times


def host_us(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """Host (CPU) microseconds per call of ``fn``: ``min(20, calls)`` warm-up calls, then
    ``perf_counter`` over ``calls`` calls with one ``sync`` before and after. On an input small
    enough that the GPU never holds the host back, this is the host's cost of a call."""
    for _ in range(min(20, calls)):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def capture_graphs(
    fn: Callable[[int], object], n_inputs: int, errors: Optional[list] = None, share_pool: bool = False
) -> Optional[list]:
    """One CUDA graph of ``fn(i)`` per input set (after a warm-up of every set on a side
    stream, as capture requires), or ``None`` where CUDA is unavailable or ``fn`` cannot be
    captured (``errors``, if given, gets the reason appended). ``share_pool``: every graph
    allocates from the first one's memory pool (one step's memory, not one per input set), for
    graphs that are replayed one at a time and whose outputs are not kept from one replay to
    the next (a training step's gradients, dropped at the next step)."""
    import torch

    if not torch.cuda.is_available():
        return None
    caller = torch.cuda.current_stream()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(n_inputs):
                fn(i)
        torch.cuda.current_stream().wait_stream(side)
        graphs = []
        for i in range(n_inputs):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=graphs[0].pool() if share_pool and graphs else None):
                fn(i)
            graphs.append(g)
    except Exception as e:  # noqa: BLE001 - reported as "not capturable" (None), never as a number
        # a call that breaks the capture (e.g. a host synchronisation) makes the capture's end
        # raise a generic error with the real cause as its context: report the first one
        first = e
        while first.__context__ is not None:
            first = first.__context__
        if errors is not None:
            errors.append(f"{type(first).__name__}: {str(first).splitlines()[0][:200] if str(first) else ''}")
        torch.cuda.set_stream(caller)  # a failed capture's end leaves its own stream current
        return None
    return graphs


def bench_graph(
    fn: Callable[[int], object], n_inputs: int, warmup: int = 3, iters: int = 30, errors: Optional[list] = None
) -> Optional[float]:
    """Median milliseconds of ``fn(i)`` replayed from CUDA graphs (one captured graph per input
    set, :func:`capture_graphs`): the GPU time alone, without the host's launch and Python
    overhead that :func:`bench` includes. ``None`` where CUDA is unavailable or ``fn`` cannot be
    captured (``errors``, if given, gets the reason appended)."""
    graphs = capture_graphs(fn, n_inputs, errors)
    if graphs is None:
        return None
    return bench(lambda i: graphs[i].replay(), n_inputs, warmup=warmup, iters=iters, cuda=True)


class _Unmonitored:
    """The monitor of a timing taken without one: no samples, no summary."""

    reason = "not monitored"

    def __init__(self, device=None) -> None:
        self.device = device

    def __enter__(self) -> "_Unmonitored":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def summary(self) -> None:
        return None


def bench_interleaved(
    fns: Dict[str, Callable[[int], object]],
    n_inputs: int,
    device,
    *,
    rounds: int,
    warmup: int,
    iters: int,
    window: int,
    b2b_warmup: int = 0,
    graphs: Optional[Dict[str, object]] = None,
    contexts: Optional[Dict[str, Callable[[], ContextManager]]] = None,
    errors: Optional[Dict[str, BaseException]] = None,
    group: int = 1,
    monitor: Optional[Callable[[object], ContextManager]] = None,
) -> Dict[str, dict]:
    """Several variants timed in ``rounds`` round-robin passes: each pass times every variant in
    turn (``ceil(iters / rounds)`` synchronised samples, then the back-to-back windows, then, for
    a variant in ``graphs``, the replays of its captured graphs), so a GPU whose clock drifts over
    the run (it warms up, meets its power cap) slows every variant alike instead of the ones
    measured last. ``rounds=1`` is the sequential order.

    Each variant's first block runs ``warmup`` untimed calls, every later block
    ``max(1, b2b_warmup)`` (the switch between variants). "Synchronised" samples wait for the GPU
    after every call; "back to back" samples queue ``window`` calls and synchronise once (half as
    many samples, at least 3). ``graphs[k]``: the variant's captured graphs (one per input set,
    replayed as they are) or a callable ``replay(i)``. ``group``: calls whose cost differs within
    a cycle of ``group`` (the first of K micro-batches re-quantises the weights) are timed over
    whole cycles, so a median cannot leave the costly call out — each synchronised or replayed
    sample is ``group`` calls, each synchronised, and the back-to-back window is rounded up to a
    multiple of ``group``. ``contexts``: per variant, a context manager entered around each of its
    blocks, untimed. ``errors``: if given, a variant whose block raises is recorded there (its
    exception) and left out of the later rounds and of the result; otherwise the exception
    propagates. ``monitor``: a class ``monitor(device)`` whose instances are entered around the
    synchronised and the back-to-back samples of every block, keep their samples across entries
    and give ``summary()`` and ``reason`` (:class:`profiling.nvml.GpuMonitor`: the GPU's clock and
    power); none by default.

    Returns per variant ``{"ms", "ms_b2b", "ms_graph", "gpu", "gpu_b2b", "gpu_reason",
    "samples"}``: the medians over all rounds, the monitors' summaries (None without one), why the
    first has none, and the sample counts."""
    rounds = max(1, rounds)
    cuda = str(device).startswith("cuda")
    per_sync = max(1, math.ceil(iters / rounds))
    per_b2b = max(1, math.ceil(max(3, iters // 2) / rounds))
    group = max(1, group)
    window = math.ceil(window / group) * group
    graphs, contexts, monitor = graphs or {}, contexts or {}, monitor or _Unmonitored
    samples = {k: {"ms": [], "ms_b2b": [], "ms_graph": []} for k in fns}
    mons = {k: {"sync": monitor(device), "b2b": monitor(device)} for k in fns}
    failed: Dict[str, BaseException] = {}
    for r in range(rounds):
        for k, fn in fns.items():
            if k in failed:
                continue
            w = warmup if r == 0 else max(1, b2b_warmup)
            try:
                with contexts.get(k, contextlib.nullcontext)():
                    with mons[k]["sync"]:
                        samples[k]["ms"] += bench_samples(
                            fn, n_inputs, warmup=w, iters=per_sync, cuda=cuda, window=group, sync_each=True
                        )
                    with mons[k]["b2b"]:
                        samples[k]["ms_b2b"] += bench_samples(
                            fn, n_inputs, warmup=b2b_warmup, iters=per_b2b, cuda=cuda, window=window
                        )
                    if graphs.get(k):
                        samples[k]["ms_graph"] += bench_samples(
                            graph_replay(graphs[k]),
                            n_inputs,
                            warmup=w,
                            iters=per_sync,
                            cuda=True,
                            window=group,
                            sync_each=True,
                        )
            except Exception as e:  # noqa: BLE001 - one variant's failure (e.g. out of memory)
                if errors is None:
                    raise
                import traceback

                traceback.print_exc()
                failed[k] = errors[k] = e
    out = {}
    for k in fns:
        if k in failed:
            continue
        sm = samples[k]
        out[k] = {
            "ms": statistics.median(sm["ms"]),
            "ms_b2b": statistics.median(sm["ms_b2b"]),
            "ms_graph": statistics.median(sm["ms_graph"]) if sm["ms_graph"] else None,
            "gpu": mons[k]["sync"].summary(),
            "gpu_b2b": mons[k]["b2b"].summary(),
            "gpu_reason": mons[k]["sync"].reason,
            "samples": {kind: len(v) for kind, v in sm.items()},
        }
    return out


def gpu_monitor(device):
    """The ``monitor`` of :func:`bench_interleaved` on ``device``: on a GPU the NVML sampler of its
    clock and power (:class:`profiling.nvml.GpuMonitor`, imported here), elsewhere None."""
    if not str(device).startswith("cuda"):
        return None
    from profiling.nvml import GpuMonitor

    return GpuMonitor


def bench_one(
    fn: Callable[[int], object],
    n_inputs: int,
    device,
    *,
    warmup: int,
    iters: int,
    window: int,
    b2b_warmup: int = 0,
    group: int = 1,
    monitor=None,
) -> dict:
    """:func:`bench_interleaved` of one variant: its synchronised (``ms``) and back-to-back
    (``ms_b2b``) medians, with the monitors' summaries and the sample counts."""
    return bench_interleaved(
        {"": fn},
        n_inputs,
        device,
        rounds=1,
        warmup=warmup,
        iters=iters,
        window=window,
        b2b_warmup=b2b_warmup,
        group=group,
        monitor=monitor,
    )[""]


def graph_replay(graphs) -> Callable[[int], object]:
    """``replay(i)`` for captured graphs (one per input set), or ``graphs`` itself if it is
    already such a callable."""
    if callable(graphs):
        return graphs
    return lambda i: graphs[i].replay()


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def fmt(v: Optional[float], spec: str, suffix: str = "") -> str:
    """``format(v, spec) + suffix``, or ``-`` for a value that was not measured."""
    return "-" if v is None else f"{v:{spec}}{suffix}"


def fmt_tflops(v: Optional[float]) -> str:
    """TFLOP/s for a table: whole numbers on a GPU, three decimals for the tiny CPU smoke runs."""
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 10 else f"{v:.3f}"


def gpu_cell(s: Optional[dict]) -> str:
    """A table cell for a GPU monitor's summary (:meth:`profiling.nvml.GpuMonitor.summary`):
    ``1980 MHz, 612 W`` (+ reasons), ``-`` without one."""
    if not s:
        return "-"
    parts = [
        f"{s['sm_mhz_median']:.0f} MHz" if s.get("sm_mhz_median") is not None else None,
        f"{s['power_w_mean']:.0f} W" if s.get("power_w_mean") is not None else None,
    ]
    cell = ", ".join(p for p in parts if p) or "-"
    return cell + (f" ({', '.join(s['clock_reasons'])})" if s.get("clock_reasons") else "")


def error_status(e: BaseException) -> str:
    """The status a benchmark row records for a variant that raised (the run goes on)."""
    msg = str(e).splitlines()[0] if str(e) else ""
    return f"error: {type(e).__name__}: {msg}"


def write_json(path: Optional[str], payload: dict) -> None:
    """Write ``payload`` to ``path`` (parent folders created); nothing when ``path`` is None."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def benchmark_device(smoke: bool, info=None) -> str:
    """The device a timing benchmark runs on: ``cpu`` for ``--smoke`` (tiny shapes, emulated FP8,
    no timing claims), else a CUDA GPU with FP8 tensor cores. Anything else exits with a message
    that names what was found and the way out: FP8 timings from emulation mean nothing.
    ``info`` (a :class:`~nemo_fp8_recipes.recipes.DeviceInfo`) stands in for the GPU in tests."""
    import torch

    from nemo_fp8_recipes.hardware import describe_device
    from nemo_fp8_recipes.recipes import check_supported, get_recipe

    if smoke:
        return "cpu"
    if info is None and not torch.cuda.is_available():
        raise SystemExit(
            "this benchmark times real FP8 GEMMs and needs a CUDA GPU with FP8 tensor cores "
            "(SM89 Ada, SM90 Hopper or newer); found no CUDA device. Run with --smoke for the "
            "tiny emulated CPU check of the code path (no timing claims)."
        )
    info = describe_device("cuda") if info is None else info
    ok, reason = check_supported(get_recipe("tensorwise", emulate=False), info)
    if not ok:
        raise SystemExit(f"this benchmark times real FP8 GEMMs: {reason}")
    return "cuda"


def recipe_mode(recipe: str, device) -> Tuple[str, str]:
    """How an FP8 recipe runs on ``device`` in a benchmark: ``("real", reason)`` (FP8 tensor
    cores), ``("emulated", reason)`` (CPU smoke runs only) or ``("skipped", reason)`` where the
    GPU lacks the format (e.g. mxfp8 on Hopper), with ``check_supported``'s reason. A benchmark
    never times the emulation on a GPU."""
    from nemo_fp8_recipes.hardware import describe_device
    from nemo_fp8_recipes.recipes import check_supported, get_recipe, uses_real_fp8_gemm

    info = describe_device(device)
    r = get_recipe(recipe)
    if not r.is_fp8:
        return "bf16", "bf16: no FP8"
    ok, reason = check_supported(r, info)
    if info.type != "cuda":
        return ("emulated", reason) if ok else ("skipped", reason)
    if uses_real_fp8_gemm(r, info):
        return "real", reason
    return "skipped", reason


def free_memory(dynamo: bool = True) -> None:
    """Drop what the previous variant left: Python garbage, compiled graphs (``dynamo=False``:
    keep them, for variants still to be timed), cached CUDA blocks."""
    import torch

    if dynamo:
        try:
            torch._dynamo.reset()
        except Exception:  # noqa: BLE001 - no dynamo (very old torch): nothing to reset
            pass
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
