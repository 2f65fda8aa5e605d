"""Timing helpers shared by the benchmarks: CUDA events, warm-up, medians, rotating inputs."""

from __future__ import annotations

import statistics
import time
from typing import Callable, List, Sequence


def bench(fn: Callable[[int], object], n_inputs: int, warmup: int = 5, iters: int = 30) -> float:
    """Median milliseconds of ``fn(i)`` (``i`` cycles over ``n_inputs`` rotating input sets so the
    L2 cache does not serve repeated reads). CUDA events on GPU, perf_counter on CPU."""
    import torch

    cuda = torch.cuda.is_available()
    for i in range(warmup):
        fn(i % n_inputs)
    if cuda:
        torch.cuda.synchronize()
    times: List[float] = []
    for i in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(i % n_inputs)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn(i % n_inputs)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)
