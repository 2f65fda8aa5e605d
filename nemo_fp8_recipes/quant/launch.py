"""Launching the Triton quantisers with less host time.

``kernel[grid](*args)`` runs Triton's ``JITFunction.run`` on every call: it re-binds and
re-specialises the arguments, builds a string cache key from the options, checks the kernel's
global variables, builds the profiler's launch metadata and then calls the compiled kernel's
launcher: tens of µs of Python per launch (``benchmarks/quant_bandwidth.py --host-overhead``;
docs/internals/kernels.md), where the kernels themselves often take less. A compiled step that
calls the quantiser operators waits for that host time.

:func:`launch` keeps, per kernel, the compiled kernels it has launched keyed by Triton's own
specialisation of the arguments (the binder Triton generates for the kernel: dtypes, pointer
alignment, integers equal to 1 or divisible by 16, constexpr values) plus the options and the
device, and launches a cached one directly through its launcher on the current stream — the
same compiled code, the same arguments, what Inductor's generated code does for its own
kernels. A new specialisation goes through ``kernel[grid](...)`` once (compile, launch) and is
cached.

It is used only where it is exact: real (not interpreted) JIT functions, no Triton launch hooks
registered (a profiler such as Proton sets them; every launch then takes Triton's own path so
the hooks see it) and no pre-run hooks on the kernel. The key includes the two options
``JITFunction.run`` adds itself (``debug``: ``TRITON_DEBUG`` / ``knobs.runtime.debug``, and the
instrumentation mode), so turning either on compiles and launches the kernel built for it.
:func:`set_fast_launch` (``KernelOptions(fast_launch=False)`` through
:func:`~nemo_fp8_recipes.nn.apply_kernel_options`) turns it off, e.g. to time both paths in
one process; :func:`fast_launch_status` says which path launches take and why.

Skipped, unlike ``JITFunction.run``: its check that the global variables a kernel reads have not
changed since it was compiled (ours read module constants only).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ..options import default_kernel_options

try:  # optional, as in triton_kernels
    import triton

    _JIT = triton.runtime.jit.JITFunction
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    _JIT = None
try:  # Triton >= 3.4 keeps the launch hooks in triton.knobs
    from triton import knobs as _knobs
except Exception:  # pragma: no cover - depends on the Triton version
    _knobs = None

__all__ = ["fast_launch_status", "launch", "launch_counts", "set_fast_launch"]

_ENABLED = default_kernel_options().fast_launch  # (KernelOptions.fast_launch; apply_kernel_options sets it)
# per JIT function: {(device, specialisation, options, debug, instrumentation mode): CompiledKernel}
_CACHE: Dict[Any, Dict[Tuple, Any]] = {}
# why the direct path is not usable here (None: it is)
_MISSING_API: Any = (
    "Triton is not installed"
    if _JIT is None
    else f"Triton {triton.__version__} has no triton.knobs (launch hooks); launches take Triton's path"
    if _knobs is None
    else None
)
_COUNTS = {"direct": 0, "triton": 0}  # launches by path, for tests and benchmarks


def launch_counts(reset: bool = False) -> Dict[str, int]:
    """How many launches took the direct path and how many Triton's own ``kernel[grid](...)``
    (first launches of a specialisation included) since the last reset."""
    out = dict(_COUNTS)
    if reset:
        _COUNTS["direct"] = _COUNTS["triton"] = 0
    return out


def set_fast_launch(enabled: bool) -> bool:
    """Turn the direct launch on or off for this process; returns the previous setting."""
    global _ENABLED
    prev, _ENABLED = _ENABLED, bool(enabled)
    return prev


def _note_gap(what: str) -> None:
    global _MISSING_API
    _MISSING_API = (
        f"Triton {triton.__version__} has no {what} (its launch internals changed); launches take Triton's path"
    )


_HookChain = getattr(_knobs, "HookChain", None)


def _hooks_idle() -> bool:
    """No launch hooks are registered: each is ``None`` (older Triton) or an empty ``HookChain``
    (Triton 3.6+); anything else (e.g. a plain function assigned to the attribute) counts as a
    hook, so the launch takes Triton's path, which calls it."""
    rt = _knobs.runtime
    a, b = rt.launch_enter_hook, rt.launch_exit_hook
    return (a is None or (type(a) is _HookChain and not a.calls)) and (
        b is None or (type(b) is _HookChain and not b.calls)
    )


def fast_launch_status() -> str:
    """``"on"``, or why launches take Triton's own path (``"off: ..."``)."""
    if not _ENABLED:
        return "off: disabled (KernelOptions(fast_launch=False) or set_fast_launch(False))"
    if _MISSING_API is not None:  # Triton missing, or a kernel lacked what the direct launch uses
        return f"off: {_MISSING_API}"
    if _knobs.runtime.interpret:  # (decided when the kernels were defined, at import)
        return "off: TRITON_INTERPRET=1 (interpreted kernels)"
    if not _hooks_idle():
        return "off: Triton launch hooks are registered (a profiler); launches take Triton's path"
    return "on"


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``: the same launch, through the compiled-kernel cache when
    it applies (module docstring). ``grid`` is a tuple of 1–3 ints."""
    # (this runs for every quantiser launch: kept to a few attribute and dict lookups)
    if (
        _ENABLED
        and type(kernel) is _JIT
        and _MISSING_API is None
        and _hooks_idle()
        and not getattr(kernel, "pre_run_hooks", None)
    ):
        device = torch._C._cuda_getDevice()
        caches = kernel.device_caches.get(device)  # (kernels, keys, target, backend, binder)
        if caches is not None:  # (None before the first launch on this device creates the binder)
            try:
                bound, spec, options = caches[4](*args, **kwargs)
            except Exception:  # noqa: BLE001 - bad arguments or another binder: Triton's path decides
                bound = None
            key = None
            if bound is not None:
                # what JITFunction.run adds to the options before it looks a kernel up
                rt = _knobs.runtime
                key = (
                    device,
                    tuple(spec),
                    tuple(options.items()),
                    bool(kwargs.get("debug", getattr(kernel, "debug", None)) or rt.debug),
                    _knobs.compilation.instrumentation_mode,
                )
                try:
                    hash(key)
                except TypeError:  # an unhashable option: Triton's path every time
                    key = None
            per_kernel = _CACHE.get(kernel)
            compiled = per_kernel.get(key) if per_kernel is not None and key is not None else None
            if compiled is not None:
                n = len(grid)
                compiled.run(
                    grid[0],
                    grid[1] if n > 1 else 1,
                    grid[2] if n > 2 else 1,
                    torch._C._cuda_getCurrentRawStream(device),
                    compiled.function,
                    compiled.packed_metadata,
                    None,
                    None,
                    None,
                    *bound.values(),
                )
                _COUNTS["direct"] += 1
                return
            compiled = kernel[grid](*args, **kwargs)  # compiles if needed, launches
            _COUNTS["triton"] += 1
            if compiled is None:  # (Triton's jit_cache_hook declined the compile: nothing launched)
                return
            if bound is None:
                _note_gap("binder of the form (bound args, specialisation, options)")
            elif not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
                _note_gap("CompiledKernel.run/function/packed_metadata")
            elif key is not None:
                _CACHE.setdefault(kernel, {})[key] = compiled
            return
    kernel[grid](*args, **kwargs)
    _COUNTS["triton"] += 1
