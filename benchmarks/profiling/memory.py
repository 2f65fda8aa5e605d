"""What is alive at a step's peak memory (``--peak-report``): one step run with the CUDA
caching allocator's history recorded (:func:`peak_memory_report`), the trace replayed to its
peak (:func:`live_at_peak`), the largest live blocks named by where they were allocated."""

from __future__ import annotations

import os
from typing import Callable, Sequence


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
    return {
        "peak_gib": peak / 2**30,
        "before_gib": (peak - during) / 2**30,
        "during_gib": during / 2**30,
        "top": [[int(e["size"]) / 2**20, _alloc_site(e.get("frames") or [])] for e in blocks],
    }


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
