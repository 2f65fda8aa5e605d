"""Where a benchmark step's time goes, from ``torch.profiler`` traces (``--breakdown``): device
time per kernel class and the top kernels (:func:`device_time_breakdown`), and the GPU's
kernel timeline — busy and idle time per step, the host's head start, the gaps between a step's
kernels and where they fall (:func:`gpu_timeline`) — with their Markdown tables."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

from _timing import table

#: Kernel classes of :func:`device_time_breakdown` (first match wins, on the lower-cased name):
#: cuBLAS/CUTLASS GEMM kernels (and the CPU matmul ops of a smoke run), this package's Triton
#: quantisers, the attention core (SDPA / flash kernels), everything else (element-wise ops and
#: Inductor's generated kernels, reductions, copies, gradient accumulation).
KERNEL_CLASSES = (
    (
        "gemm",
        (
            "gemm",
            "xmma",
            "cutlass",
            "nvjet",
            "cublas",
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::_scaled_mm",
            "aten::matmul",
        ),
    ),
    (
        "quantise (Triton)",
        (
            "quant_rows",
            "quant_cols",
            "quant_block",
            "quant_dual",
            "cast_kernel",
            "cast_dual",
            "amax_atomic",
            "delayed_commit",
        ),
    ),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
)


def classify_kernel(name: str) -> str:
    """The :data:`KERNEL_CLASSES` class of a profiled kernel (or CPU op) name, else ``other``."""
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def device_time_breakdown(
    fn: Callable[[int], object], n_inputs: int, steps: int = 3, top: int = 10, cuda: Optional[bool] = None
) -> dict:
    """Where a step's time goes, from ``torch.profiler``: milliseconds per step of each kernel
    class (:func:`classify_kernel`), their sum (``kernels_ms``) and the ``top`` most expensive
    kernels by name as ``[name, ms per step, launches per step]``. On a GPU these are the CUDA
    kernels' own times (idle gaps between kernels are not included, so ``kernels_ms`` <= the
    event-timed step; the difference is host-bound time); on CPU (smoke runs) the self time of the ATen
    ops. One warm-up call, then ``steps`` profiled calls over the rotating inputs. ``cuda``: profile
    CUDA kernels (default: when CUDA is available) or CPU ops (a benchmark forced onto the CPU, e.g.
    ``--smoke`` on a GPU host)."""
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
    out["top"] = [[name, ms, calls[name]] for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]]
    out["source"] = "CUDA kernels" if cuda else "CPU ATen ops (self time)"
    return out


#: Table labels of the kernel classes
CLASS_LABELS = {"gemm": "GEMM", "quantise (Triton)": "quantise (Triton)", "attention": "attention", "other": "other"}


def breakdown_table(rows: Sequence[dict], keys: Sequence[str], classes: Sequence[str], top: int = 3) -> str:
    """The Markdown table of the rows' ``breakdown`` (:func:`device_time_breakdown`), with a
    heading line: the ``keys`` columns, the step's median ms, the profiled kernel ms, the ms of
    each of ``classes`` and the ``top`` kernels by name."""
    head = f"where the time goes ({rows[0]['breakdown']['source']}, ms per step, torch.profiler):\n\n"
    hdr = list(keys) + ["step ms (median)", "kernels ms"] + [CLASS_LABELS[c] for c in classes] + ["top kernels"]
    out = [
        tuple(r[k] for k in keys)
        + ("-" if r.get("ms") is None else f"{r['ms']:.2f}",)
        + tuple(f"{r['breakdown'][c]:.2f}" for c in ("kernels_ms", *classes))
        + ("; ".join(f"{n[:40]} {t:.2f} ({c:g}x)" for n, t, c in r["breakdown"]["top"][:top]),)
        for r in rows
    ]
    return head + table(hdr, out)


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
        return {
            "span": 0.0,
            "busy": 0.0,
            "idle_first": 0.0,
            "idle_steady": 0.0,
            "lead": 0.0,
            "idle_in_step": 0.0,
            "kernels": 0.0,
            "gap_sites": [],
        }
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
    return {
        "span": (end - ev[0][0]) / 1e3 / steps,
        "busy": busy_total / 1e3 / steps,
        "idle_first": idle[0] / 1e3,
        "idle_steady": steady,
        "lead": lead_ms,
        "idle_in_step": steady - lead_ms,
        "kernels": len(ev) / steps,
        "gap_sites": [
            [n, t / 1e3 / later, c / later] for n, (t, c) in sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
        ],
    }


def gpu_timeline(fn: Callable[[int], object], n_inputs: int, steps: int = 6, sync_each: bool = False) -> Optional[dict]:
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
    iv = [
        (ev.time_range.start, ev.time_range.end, ev.name)
        for ev in prof.events()
        if ev.device_type == DeviceType.CUDA and ev.time_range.end > ev.time_range.start
    ]
    return timeline_stats(iv, steps)


def timeline_table(rows: Sequence[dict], keys: Sequence[str], graph: bool = False) -> str:
    """The Markdown table of the rows' ``timeline`` (steps back to back), ``timeline_sync``
    (synchronised after every step) and, with ``graph``, ``timeline_graph`` (CUDA-graph
    replays) from :func:`gpu_timeline`, in ms per step, with a heading line."""

    def cell(t, key, spec=".3f"):
        return "-" if not t else format(t[key], spec)

    head = (
        "GPU timeline (CUDA-only torch.profiler trace; ms per step): busy = kernels running; "
        "idle = the GPU waiting for the host — in step 1 of a back-to-back run (the head start), "
        "per later step, and with a synchronisation after every step as 'ms (median)' runs them: "
        "the lead from the synchronisation to the step's first kernel and the gaps inside the step; "
        "'idle went to' = where the synchronised steps' in-step gaps were\n\n"
    )
    hdr = (
        list(keys)
        + ["busy", "b2b: idle step 1", "b2b: idle/step", "sync: lead", "sync: idle in step", "kernels/step"]
        + (["graph: busy", "graph: idle/step"] if graph else [])
        + ["idle went to"]
    )
    out = []
    for r in rows:
        t, ts, tg = r.get("timeline"), r.get("timeline_sync"), r.get("timeline_graph")
        sites = (ts or t or {}).get("gap_sites", [])
        out.append(
            tuple(r[k] for k in keys)
            + (
                cell(t, "busy", ".2f"),
                cell(t, "idle_first"),
                cell(t, "idle_steady"),
                cell(ts, "lead"),
                cell(ts, "idle_in_step"),
                cell(t, "kernels", "g"),
            )
            + ((cell(tg, "busy", ".2f"), cell(tg, "idle_steady")) if graph else ())
            + ("; ".join(f"{n} {ms:.3f} ({c:g}x)" for n, ms, c in sites[:3]) or "-",)
        )
    return head + table(hdr, out)
