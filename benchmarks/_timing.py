"""Helpers shared by the benchmarks: CUDA events, warm-up, medians, rotating inputs, Markdown
tables, JSON output, and the device checks every FP8 benchmark makes before it measures."""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Tuple


def bench(fn: Callable[[int], object], n_inputs: int, warmup: int = 5, iters: int = 30,
          cuda: Optional[bool] = None, window: int = 1) -> float:
    """Median milliseconds per call of ``fn(i)`` (``i`` cycles over ``n_inputs`` rotating input
    sets so the L2 cache does not serve repeated reads). CUDA events on GPU, perf_counter on CPU;
    ``cuda`` forces one or the other (default: CUDA events when CUDA is available).

    Each of the ``iters`` samples times ``window`` calls and synchronises once. ``window=1``
    synchronises after every call, so each call also pays the host's latency before its first
    kernel; ``window > 1`` ("back to back") queues the calls as a training loop that does not
    wait on the GPU every step runs them: the host prepares call ``i + 1`` while the GPU still
    runs call ``i``."""
    return statistics.median(bench_samples(fn, n_inputs, warmup, iters, cuda, window))


def bench_samples(fn: Callable[[int], object], n_inputs: int, warmup: int = 5, iters: int = 30,
                  cuda: Optional[bool] = None, window: int = 1, start: int = 0,
                  sync_each: bool = False) -> List[float]:
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
    import time

    for _ in range(min(20, calls)):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def capture_graphs(fn: Callable[[int], object], n_inputs: int,
                   errors: Optional[list] = None, share_pool: bool = False) -> Optional[list]:
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


def bench_graph(fn: Callable[[int], object], n_inputs: int, warmup: int = 3, iters: int = 30,
                errors: Optional[list] = None) -> Optional[float]:
    """Median milliseconds of ``fn(i)`` replayed from CUDA graphs (one captured graph per input
    set, :func:`capture_graphs`): the GPU time alone, without the host's launch and Python
    overhead that :func:`bench` includes. ``None`` where CUDA is unavailable or ``fn`` cannot be
    captured (``errors``, if given, gets the reason appended)."""
    graphs = capture_graphs(fn, n_inputs, errors)
    if graphs is None:
        return None
    return bench(lambda i: graphs[i].replay(), n_inputs, warmup=warmup, iters=iters, cuda=True)


def bench_interleaved(fns: Dict[str, Callable[[int], object]], n_inputs: int, device, *, rounds: int,
                      warmup: int, iters: int, window: int, b2b_warmup: int = 0,
                      graphs: Optional[Dict[str, object]] = None,
                      contexts: Optional[Dict[str, Callable[[], ContextManager]]] = None,
                      errors: Optional[Dict[str, BaseException]] = None, group: int = 1) -> Dict[str, dict]:
    """:func:`bench_with_gpu` for several variants at once, in ``rounds`` round-robin passes:
    each pass times every variant in turn (``ceil(iters / rounds)`` synchronised samples, then
    the back-to-back windows, then, for a variant in ``graphs``, the replays of its captured
    graphs), so a GPU whose clock drifts over the run (it warms up, meets its power cap) slows
    every variant alike instead of the ones measured last. Each variant's first block runs
    ``warmup`` untimed calls, every later block ``max(1, b2b_warmup)`` (the switch between
    variants). ``graphs[k]``: the variant's captured graphs (one per input set, replayed as
    they are) or a callable ``replay(i)`` (e.g. one that also runs eager work between
    replays). ``group``: calls whose cost differs within a cycle of ``group`` (the first of K
    micro-batches re-quantises the weights) are timed over whole cycles, so a median cannot
    leave the costly call out — each synchronised or replayed sample is ``group`` calls, each
    synchronised (``bench_samples(sync_each=True)``), and the back-to-back window is rounded up
    to a multiple of ``group``. ``rounds=1`` is the sequential order. Returns per variant ``{"ms", "ms_b2b",
    "ms_graph", "gpu", "gpu_b2b", "gpu_reason", "samples"}``: medians over all rounds, the GPU
    monitors' summaries over all of a variant's blocks, the sample counts. ``contexts``: per
    variant, a context manager entered around each of its blocks, untimed (e.g. the settings a
    variant runs with). ``errors``: if given, a variant whose block raises is recorded there
    (its exception), left out of the later rounds and of the result, and the others go on;
    otherwise the exception propagates."""
    import contextlib
    import math

    cuda = str(device).startswith("cuda")
    rounds = max(1, rounds)
    per_sync = max(1, math.ceil(iters / rounds))
    per_b2b = max(1, math.ceil(max(3, iters // 2) / rounds))
    group = max(1, group)
    window = math.ceil(window / group) * group
    graphs = graphs or {}
    samples = {k: {"ms": [], "ms_b2b": [], "ms_graph": []} for k in fns}
    mons = {k: {"sync": GpuMonitor(device), "b2b": GpuMonitor(device)} for k in fns}
    gsamples: Dict[str, Dict[str, list]] = {k: {"sync": [], "b2b": []} for k in fns}
    contexts = contexts or {}
    failed: Dict[str, BaseException] = {}
    for r in range(rounds):
        for k, fn in fns.items():
            if k in failed:
                continue
            try:
                with contexts.get(k, contextlib.nullcontext)():
                    _bench_block(k, fn, n_inputs, cuda, warmup if r == 0 else max(1, b2b_warmup), per_sync,
                                 per_b2b, b2b_warmup, window, samples, mons, gsamples, graphs, group)
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
        for kind in ("sync", "b2b"):  # the summaries over every block of this variant
            mons[k][kind].samples = gsamples[k][kind]
        sm = samples[k]
        out[k] = {"ms": statistics.median(sm["ms"]), "ms_b2b": statistics.median(sm["ms_b2b"]),
                  "ms_graph": statistics.median(sm["ms_graph"]) if sm["ms_graph"] else None,
                  "gpu": mons[k]["sync"].summary(), "gpu_b2b": mons[k]["b2b"].summary(),
                  "gpu_reason": mons[k]["sync"].reason,
                  "samples": {kind: len(v) for kind, v in sm.items()}}
    return out


def _bench_block(k, fn, n_inputs, cuda, w, per_sync, per_b2b, b2b_warmup, window, samples, mons, gsamples,
                 graphs, group=1) -> None:
    """One variant's block of one round of :func:`bench_interleaved`: its synchronised samples,
    its back-to-back windows, the replays of its graphs."""
    with mons[k]["sync"] as mon:
        samples[k]["ms"] += bench_samples(fn, n_inputs, warmup=w, iters=per_sync, cuda=cuda, window=group,
                                          sync_each=True)
    gsamples[k]["sync"] += mon.samples
    with mons[k]["b2b"] as mon:
        samples[k]["ms_b2b"] += bench_samples(fn, n_inputs, warmup=b2b_warmup, iters=per_b2b,
                                              cuda=cuda, window=window)
    gsamples[k]["b2b"] += mon.samples
    if graphs.get(k):
        samples[k]["ms_graph"] += bench_samples(graph_replay(graphs[k]), n_inputs, warmup=w, iters=per_sync,
                                                cuda=True, window=group, sync_each=True)


def graph_replay(graphs) -> Callable[[int], object]:
    """``replay(i)`` for captured graphs (one per input set), or ``graphs`` itself if it is
    already such a callable."""
    if callable(graphs):
        return graphs
    return lambda i: graphs[i].replay()


#: Kernel classes of :func:`device_time_breakdown` (first match wins, on the lower-cased name):
#: cuBLAS/CUTLASS GEMM kernels (and the CPU matmul ops of a smoke run), this package's Triton
#: quantisers, the attention core (SDPA / flash kernels), everything else (element-wise ops and
#: Inductor's generated kernels, reductions, copies, gradient accumulation).
KERNEL_CLASSES = (
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::_scaled_mm", "aten::matmul")),
    ("quantise (Triton)", ("_quant_rows", "_quant_cols", "_quant_block", "_quant_dual", "_cast_kernel",
                           "_cast_dual", "_amax_atomic", "_delayed_commit")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
)


def classify_kernel(name: str) -> str:
    """The :data:`KERNEL_CLASSES` class of a profiled kernel (or CPU op) name, else ``other``."""
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def device_time_breakdown(fn: Callable[[int], object], n_inputs: int, steps: int = 3, top: int = 10,
                          cuda: Optional[bool] = None) -> dict:
    """Where a step's time goes, from ``torch.profiler``: milliseconds per step of each kernel
    class (:func:`classify_kernel`), their sum (``kernels_ms``) and the ``top`` most expensive
    kernels by name as ``[name, ms per step, launches per step]``. On a GPU these are the CUDA kernels' own times (idle gaps between kernels
    are not included, so ``kernels_ms`` <= the event-timed step; the difference is host-bound
    time); on CPU (smoke runs) the self time of the ATen ops. One warm-up call, then ``steps``
    profiled calls over the rotating inputs. ``cuda``: profile CUDA kernels (default: when CUDA
    is available) or CPU ops (a benchmark forced onto the CPU, e.g. ``--smoke`` on a GPU host)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if cuda is None:
        cuda = torch.cuda.is_available()
    fn(0)
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for i in range(steps):
            fn(i % n_inputs)
        if cuda:
            torch.cuda.synchronize()
    per_kernel, calls = {}, {}
    for ev in prof.key_averages():
        if cuda:
            if ev.device_type != DeviceType.CUDA:
                continue
            us = getattr(ev, "self_device_time_total", None)
            us = ev.self_cuda_time_total if us is None else us
        else:
            if not ev.key.startswith("aten::"):
                continue
            us = ev.self_cpu_time_total
        if us > 0:
            per_kernel[ev.key] = per_kernel.get(ev.key, 0.0) + us / 1e3 / steps
            calls[ev.key] = calls.get(ev.key, 0) + ev.count / steps
    out = {cls: 0.0 for cls, _ in KERNEL_CLASSES}
    out["other"] = 0.0
    for name, ms in per_kernel.items():
        out[classify_kernel(name)] += ms
    out["kernels_ms"] = sum(per_kernel.values())
    out["top"] = [[name, ms, calls[name]]
                  for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]]
    out["source"] = "CUDA kernels" if cuda else "CPU ATen ops (self time)"
    return out


def timeline_stats(intervals: Sequence[Tuple[float, float, str]], steps: int, top: int = 5) -> dict:
    """Busy and idle time of one stream's kernel timeline: ``intervals`` are ``(start_us, end_us,
    name)`` of every kernel (and memset/memcpy) of ``steps`` calls. The calls are split by kernel
    count (the same kernels every call). Returns per call, in ms: ``span`` (first kernel's start
    to the last one's end over all calls, divided by ``steps``), ``busy`` (the union of kernel
    intervals), ``idle_first`` (the GPU waiting inside the first call: the host's head start),
    ``idle_steady`` (mean idle of the later calls) split into ``lead`` (the gap before each later
    call's first kernel: after a synchronisation, the host's latency to its first launch) and
    ``idle_in_step`` (the gaps between a call's own kernels: where the GPU ran out of queued
    work); ``kernels`` per call, and ``gap_sites``: the ``top`` places the later calls' in-step
    idle went, as ``["previous kernel -> next kernel", idle ms per call, occurrences per call]``."""
    ev = sorted(intervals, key=lambda t: (t[0], t[1]))
    if not ev or steps < 1:
        return {"span": 0.0, "busy": 0.0, "idle_first": 0.0, "idle_steady": 0.0, "lead": 0.0,
                "idle_in_step": 0.0, "kernels": 0.0, "gap_sites": []}
    per = len(ev) / steps
    busy_total, idle, lead = 0.0, [0.0] * steps, 0.0
    sites: dict = {}
    end, prev, last_step = ev[0][0], "", 0
    for k, (s, e, name) in enumerate(ev):
        step = min(int(k // per), steps - 1) if per >= 1 else 0
        gap = max(0.0, s - end)
        idle[step] += gap
        if step > 0 and gap > 0:
            if step != last_step:
                lead += gap
            else:
                site = f"{prev[:40]} -> {name[:40]}"
                tot, n = sites.get(site, (0.0, 0))
                sites[site] = (tot + gap, n + 1)
        busy_total += max(0.0, e - max(s, end))
        end, prev, last_step = max(end, e), name, step
    later = max(1, steps - 1)
    steady = sum(idle[1:]) / 1e3 / later if steps > 1 else 0.0
    lead_ms = lead / 1e3 / later if steps > 1 else 0.0
    return {"span": (end - ev[0][0]) / 1e3 / steps, "busy": busy_total / 1e3 / steps,
            "idle_first": idle[0] / 1e3, "idle_steady": steady, "lead": lead_ms,
            "idle_in_step": steady - lead_ms, "kernels": len(ev) / steps,
            "gap_sites": [[n, t / 1e3 / later, c / later]
                          for n, (t, c) in sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]]}


def gpu_timeline(fn: Callable[[int], object], n_inputs: int, steps: int = 6,
                 sync_each: bool = False) -> Optional[dict]:
    """:func:`timeline_stats` of ``steps`` calls of ``fn(i)`` after one synchronised warm-up
    call, from a CUDA-only ``torch.profiler`` trace (no CPU-op recording, so the host runs at
    close to its normal speed): queued back to back, or with ``sync_each`` synchronised after
    every call as the "ms (median)" timing runs them (its ``lead`` is then the host's latency
    from one call's start to its first kernel). ``None`` without CUDA."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return None
    fn(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            fn(i % n_inputs)
            if sync_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    iv = [(ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
          if ev.device_type == DeviceType.CUDA and ev.time_range.end > ev.time_range.start]
    return timeline_stats(iv, steps)


def timeline_table(rows: Sequence[dict], keys: Sequence[str], graph: bool = False) -> str:
    """The Markdown table of the rows' ``timeline`` (steps back to back), ``timeline_sync``
    (synchronised after every step) and, with ``graph``, ``timeline_graph`` (CUDA-graph
    replays) from :func:`gpu_timeline`, in ms per step, with a heading line."""
    def cell(t, key, spec=".3f"):
        return "-" if not t else format(t[key], spec)

    head = ("GPU timeline (CUDA-only torch.profiler trace; ms per step): busy = kernels running; "
            "idle = the GPU waiting for the host — in step 1 of a back-to-back run (the head start), "
            "per later step, and with a synchronisation after every step as 'ms (median)' runs them: "
            "the lead from the synchronisation to the step's first kernel and the gaps inside the step; "
            "'idle went to' = where the synchronised steps' in-step gaps were\n\n")
    hdr = list(keys) + ["busy", "b2b: idle step 1", "b2b: idle/step", "sync: lead", "sync: idle in step",
                        "kernels/step"] + (["graph: busy", "graph: idle/step"] if graph else []) + ["idle went to"]
    out = []
    for r in rows:
        t, ts, tg = r.get("timeline"), r.get("timeline_sync"), r.get("timeline_graph")
        sites = (ts or t or {}).get("gap_sites", [])
        out.append(tuple(r[k] for k in keys) + (
            cell(t, "busy", ".2f"), cell(t, "idle_first"), cell(t, "idle_steady"), cell(ts, "lead"),
            cell(ts, "idle_in_step"), cell(t, "kernels", "g"))
            + ((cell(tg, "busy", ".2f"), cell(tg, "idle_steady")) if graph else ())
            + ("; ".join(f"{n} {ms:.3f} ({c:g}x)" for n, ms, c in sites[:3]) or "-",))
    return head + table(hdr, out)


def live_at_peak(events: Sequence[dict], base_bytes: int, top: int = 12) -> dict:
    """Replay a CUDA caching-allocator trace (``torch.cuda.memory._snapshot()["device_traces"]``,
    oldest event first): ``alloc`` adds a block, ``free_requested`` removes it (when
    ``memory_allocated`` drops). ``base_bytes``: what was allocated when the trace began.
    Returns the peak (``peak_gib``), the GiB of blocks allocated before the trace still alive
    then (``before_gib``: parameters, inputs, gradients) and the ``top`` largest blocks
    allocated during the trace and alive at the peak as ``[MiB, where]`` with ``where`` from
    :func:`_alloc_site`."""
    cur = peak = base_bytes
    live: dict = {}
    at_peak: dict = {}
    for e in events:
        act, addr, size = e.get("action"), e.get("addr"), int(e.get("size", 0))
        if act == "alloc":
            live[addr] = e
            cur += size
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif act == "free_requested":
            live.pop(addr, None)
            cur -= size
    during = sum(int(e["size"]) for e in at_peak.values())
    blocks = sorted(at_peak.values(), key=lambda e: -int(e["size"]))[:top]
    return {"peak_gib": peak / 2**30, "before_gib": (peak - during) / 2**30,
            "during_gib": during / 2**30,
            "top": [[int(e["size"]) / 2**20, _alloc_site(e.get("frames") or [])] for e in blocks]}


def _alloc_site(frames: Sequence[dict]) -> str:
    """Where a block was allocated, for a person: the innermost Python frame in this package or
    in Inductor's generated code (with that line's text and the source-node comment above it),
    else the innermost frame."""
    def text(fr):
        try:
            with open(fr["filename"]) as f:
                lines = f.readlines()
        except OSError:
            return ""
        i = int(fr["line"]) - 1
        note = ""
        for j in range(i - 1, max(-1, i - 8), -1):
            if "Source Nodes" in lines[j] or "Topologically Sorted" in lines[j]:
                note = " | " + lines[j].strip()[:160]
                break
        return lines[i].strip()[:160] + note if 0 <= i < len(lines) else ""

    for keys in (("nemo_fp8_recipes", "torchinductor"), ("/benchmarks/",)):
        for fr in frames:
            fn = fr.get("filename", "")
            if any(k in fn for k in keys):
                where = f"{os.path.basename(fn)}:{fr.get('line')} {fr.get('name')}"
                return f"{where}: {text(fr)}" if "torchinductor" in fn else where
    if frames:
        fr = frames[0]
        return f"{os.path.basename(fr.get('filename', '?'))}:{fr.get('line')} {fr.get('name')}"
    return "?"


def peak_memory_report(fn: Callable[[int], object], i: int = 0, top: int = 12, others_bytes: int = 0) -> dict:
    """Run ``fn(i)`` once (CUDA) with the allocator's history recorded and say what is alive at
    its peak (:func:`live_at_peak`): which activations, codes and workspaces make a variant's
    peak memory. ``others_bytes``: memory allocated by others (e.g. the other variants of a
    round-robin run), left out of the totals."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() - others_bytes
    torch.cuda.memory._record_memory_history(max_entries=500_000)
    try:
        fn(i)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    dev = torch.cuda.current_device()
    return live_at_peak(snap["device_traces"][dev], base, top=top)


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

    from nemo_fp8_recipes.recipes import check_supported, describe_device, get_recipe

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
    from nemo_fp8_recipes.recipes import (
        check_supported, describe_device, get_recipe, uses_real_fp8_gemm,
    )

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


#: NVML clock-event ("throttle") reason bits worth reporting next to a timing
_CLOCK_REASONS = {0x4: "sw-power-cap", 0x8: "hw-slowdown", 0x20: "sw-thermal", 0x40: "hw-thermal",
                  0x80: "hw-power-brake"}


class GpuMonitor:
    """What the GPU ran at while a measurement ran: NVML samples of the SM clock, the power draw,
    the temperature and the clock-event reasons (power cap, thermal slowdown), taken every
    ``interval`` seconds in a background thread during the ``with`` block::

        with GpuMonitor("cuda") as mon:
            ms = bench(step, 3)
        mon.summary()  # {"sm_mhz_median": 1980, "power_w_mean": 612.0, ...} or None

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
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        except Exception as e:  # noqa: BLE001
            if os.environ.get("CUDA_VISIBLE_DEVICES") is None:  # torch's index is NVML's
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(idx)
            else:
                self._note(f"NVML: device {idx} not found by UUID ({type(e).__name__}: {e}) and "
                           "CUDA_VISIBLE_DEVICES renumbers devices: not sampled")
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
        get_reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons",
                              getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
        reads = {"sm_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                 "power_w": lambda: nv.nvmlDeviceGetPowerUsage(h) / 1e3,
                 "temp_c": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                 "reasons": lambda: get_reasons(h)}
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

        self.samples, self.reason = [], None
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
        return {"sm_mhz_median": statistics.median(clk) if clk else None, "sm_mhz_min": min(clk, default=None),
                "power_w_mean": statistics.fmean(pw) if pw else None, "power_w_max": max(pw, default=None),
                "power_limit_w": self.power_limit_w, "temp_c_max": max(temp, default=None),
                "clock_reasons": [n for bit, n in _CLOCK_REASONS.items() if seen & bit],
                "samples": len(self.samples)}


def bench_with_gpu(fn: Callable[[int], object], n_inputs: int, device, *, warmup: int, iters: int,
                   window: int, b2b_warmup: int = 0, group: int = 1) -> dict:
    """The two timings the linear and layer benchmarks report, each under a :class:`GpuMonitor`:
    ``ms`` synchronised after every call (:func:`bench`, ``warmup`` calls first) and ``ms_b2b``
    per call of ``window`` calls queued back to back (``b2b_warmup`` calls first, half as many
    samples, at least 3) — :func:`bench_interleaved` of this one variant. Returns ``{"ms",
    "ms_b2b", "gpu", "gpu_b2b", "gpu_reason"}`` (the monitors' summaries, and why the first
    recorded nothing, if it did not), with its ``ms_graph`` (None) and ``samples``; ``group`` as
    there."""
    return bench_interleaved({"": fn}, n_inputs, device, rounds=1, warmup=warmup, iters=iters,
                             window=window, b2b_warmup=b2b_warmup, group=group)[""]


def energy_window(fns: Dict[str, Callable[[int], object]], n_inputs: int, device, *, seconds: float,
                  rounds: int = 2,
                  contexts: Optional[Dict[str, Callable[[], ContextManager]]] = None,
                  group: int = 1) -> Dict[str, dict]:
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
    (:func:`bench_interleaved`'s); ``group``: the call count is a multiple of it (whole cycles,
    as there)."""
    import contextlib
    import math

    import torch

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
                    ms, joules, extra = _energy_of(mon, lambda: bench_samples(
                        fn, n_inputs, warmup=0, iters=1, cuda=cuda, window=calls)[0])
            samples[name]["ms"].append(ms)
            if joules is not None:
                samples[name]["j"].append(joules / calls)
                samples[name].setdefault("idle", []).append(extra)
            out[name] = {"gpu": mon.summary(), "calls": calls,
                         "idle_w": [x["idle_w"] for x in samples[name].get("idle", [])],
                         "counter_wait_ms": [x["counter_wait_ms"] for x in samples[name].get("idle", [])],
                         "energy_reason": None if samples[name]["j"] else (mon.reason or "energy counter did not advance")}
    for name, s in samples.items():
        ms = statistics.median(s["ms"])
        j = statistics.median(s["j"]) if s["j"] else None
        out[name].update(ms=ms, j=j, w=None if j is None else j / (ms / 1e3))
    return out


def _energy_tick(mon: "GpuMonitor", timeout_s: float = 0.5) -> Tuple[Optional[int], Optional[float], float]:
    """The board's energy counter read as soon as it next advances: ``(mJ, when (perf_counter
    s), ms waited)``. The driver refreshes the counter periodically (every 100 ms on the H200:
    docs/results/energy_tick_session26), not at every read, so a read right after the GPU's work
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
        mon._note(f"window of {(t1 - t0) * 1e3:.0f} ms is under three refreshes of the energy counter "
                  f"({interval * 1e3:.0f} ms each): too short to read")
        return ms, None, None
    return ms, joules, {"idle_w": idle_w, "counter_wait_ms": wait_ms}


def gpu_cell(s: Optional[dict]) -> str:
    """A table cell for a :meth:`GpuMonitor.summary`: ``1980 MHz, 612 W`` (+ reasons)."""
    if not s:
        return "-"
    parts = [f"{s['sm_mhz_median']:.0f} MHz" if s.get("sm_mhz_median") is not None else None,
             f"{s['power_w_mean']:.0f} W" if s.get("power_w_mean") is not None else None]
    cell = ", ".join(p for p in parts if p) or "-"
    return cell + (f" ({', '.join(s['clock_reasons'])})" if s.get("clock_reasons") else "")
