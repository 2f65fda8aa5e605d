"""Optional profiling tools for the benchmarks, imported only by the options that use them:

* :mod:`.timeline` — ``--breakdown``: device time per kernel class and the GPU's kernel timeline
  (busy / idle per step), from ``torch.profiler`` traces;
* :mod:`.memory` — ``--peak-report``: the blocks alive at a step's peak memory, from the CUDA
  allocator's history;
* :mod:`.nvml` — the GPU's SM clock and power beside each timing on a GPU, and ``--energy``:
  joules per call from the board's energy counter (``nvidia-ml-py``);
* ``host_profile.py`` — a script: the host (CPU) time of one FP8 MLP step and a ``cProfile`` of
  where it goes.

The modules import the benchmarks' :mod:`_timing`, so the ``benchmarks/`` folder is on
``sys.path`` (each benchmark script puts it there).
"""
