"""Deterministic training: the same config and seed give bit-identical results, run after run.

Run-to-run variation on one GPU comes from kernels whose result depends on the order in which
threads finish, not from the data (the trainer's data order is a pure function of seed and step)
or from FP8 (our quantisers fold amaxes with an atomic *max*, which does not depend on order).
The sources, and what :func:`deterministic_mode` does about each:

- **Atomic-add reductions in PyTorch's kernels**: ``index_add_`` / ``scatter_add_`` (the MoE
  combine) and the attention backward. On Hopper with a recent cuDNN, PyTorch's SDPA runs cuDNN
  attention, whose backward is not deterministic; FlashAttention's accumulates dQ with atomics.
  ``torch.use_deterministic_algorithms(True)`` makes PyTorch take its deterministic
  implementations (``index_put_`` accumulation for the scatters, FlashAttention's deterministic
  backward, cuDNN attention left out — so a deterministic run's attention is another kernel than a
  default run's) and raise for any operator that has none: an error naming the operator, never a
  silent fallback.
- **cuBLAS workspaces**: cuBLAS and cuBLASLt (``torch._scaled_mm``) give the same bits for the
  same problem on one stream. ``CUBLAS_WORKSPACE_CONFIG`` is set to ``:4096:8`` (the size
  PyTorch's default already has on Hopper) where it is unset, for the PyTorch versions that
  require it under deterministic algorithms.
- **cuDNN autotuning**: ``torch.backends.cudnn.benchmark`` off, ``cudnn.deterministic`` on.
- **Inductor's autotuning** (``torch.compile``): timing kernel configurations on the device picks
  the fastest of several reduction orders, which can change between runs.
  ``torch._inductor.config.deterministic`` (set here; torch 2.11 also sets it with deterministic
  algorithms) chooses them by heuristic instead, and Inductor falls back to PyTorch's
  deterministic kernels for scatters with atomics (the embedding's backward among them).
- **Transformer Engine** (``backend=te``): ``te.Linear``'s kernels are deterministic (cuBLASLt
  GEMMs, amaxes folded with an atomic max). ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` is set for TE's
  own attention, which our TE backend does not use (its attention is PyTorch's SDPA, under the
  settings above).

Memory is not filled before use (``torch.utils.deterministic.fill_uninitialized_memory``, on by
default under deterministic algorithms, is turned off): every kernel of the native path writes all
of its output, which the poisoned-output kernel tests check, and filling every ``torch.empty``
costs a write pass in every step. Router ties (``topk`` over equal FP32 scores) and data order
are not a concern: the scores are FP32 and the data order is a function of seed and step.

Everything is process-wide; :func:`deterministic_mode` sets it and restores what was there
before on exit. On CPU, PyTorch's kernels are already deterministic for a fixed thread count
(the settings are applied all the same). Under ``torchrun`` the settings apply on every rank;
the gradient all-reduce is then as deterministic as its backend (gloo: yes; NCCL: for an
unchanged topology, NCCL version and algorithm).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Dict, Iterator, Optional

import torch

__all__ = ["CUBLAS_WORKSPACE_CONFIG", "DeterminismError", "deterministic_mode", "explain_nondeterministic_op"]

log = logging.getLogger("nemo_fp8_recipes.determinism")

#: The deterministic cuBLAS workspace configuration PyTorch asks for (4096 KiB x 8 buffers).
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
_CUBLAS_OK = (":4096:8", ":16:8")
_TE_ENV = "NVTE_ALLOW_NONDETERMINISTIC_ALGO"


class DeterminismError(RuntimeError):
    """An operator that has no deterministic implementation ran under :func:`deterministic_mode`."""


def _inductor_config():
    try:
        import torch._inductor.config as cfg
    except Exception:  # noqa: BLE001 - a torch without Inductor: nothing to configure
        return None
    return cfg if hasattr(cfg, "deterministic") else None


@contextlib.contextmanager
def deterministic_mode(enabled: bool = True, *, transformer_engine: bool = False) -> Iterator[Dict[str, object]]:
    """Make every kernel this process runs deterministic while the context is open (``enabled``;
    ``False`` changes nothing). Yields what was set (for the run's log and summary).

    ``transformer_engine``: also ask Transformer Engine for deterministic kernels (must be entered
    before TE is imported to take effect for its attention; te.Linear has no such switch).
    """
    if not enabled:
        yield {}
        return
    saved_env = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", _TE_ENV)}
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    inductor = _inductor_config()
    saved_inductor = inductor.deterministic if inductor is not None else None
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if cublas not in _CUBLAS_OK:
        if cublas:
            log.warning(
                "CUBLAS_WORKSPACE_CONFIG=%s is not one of cuBLAS' deterministic settings; using %s",
                cublas,
                CUBLAS_WORKSPACE_CONFIG,
            )
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
    if transformer_engine:
        os.environ[_TE_ENV] = "0"
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.utils.deterministic.fill_uninitialized_memory = False
    if inductor is not None:
        inductor.deterministic = True
    applied: Dict[str, object] = {
        "use_deterministic_algorithms": True,
        "cublas_workspace_config": os.environ["CUBLAS_WORKSPACE_CONFIG"],
        "cudnn_deterministic": True,
        "cudnn_benchmark": False,
        "inductor_deterministic": inductor is not None,
        "fill_uninitialized_memory": False,
    }
    if transformer_engine:
        applied[_TE_ENV] = "0"
    try:
        yield applied
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
        torch.utils.deterministic.fill_uninitialized_memory = saved[4]
        if inductor is not None:
            inductor.deterministic = saved_inductor
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def explain_nondeterministic_op(err: BaseException, where: str = "this device") -> Optional[str]:
    """If ``err`` is PyTorch's refusal of an operator that has no deterministic implementation,
    the message to show instead (the operator, and the ways out); else None."""
    text = str(err)
    if "does not have a deterministic implementation" not in text:
        return None
    op = text.split(", but you set")[0].strip().splitlines()[0]
    return (
        f"deterministic mode cannot run this model on {where}: {op}, and PyTorch {torch.__version__} has no "
        "deterministic implementation of it. Turn deterministic mode off (trainer.deterministic=false: the "
        "run is then reproducible only to rounding), or change the part of the model that uses it"
    )
