"""How much memory a training run needs, estimated before anything is allocated.

The embedded trainer calls :func:`check_fits` once the model, batch and device are known: a run
that cannot fit is refused at once with the estimate and what would fit (``model.num_layers=N``,
a smaller model, a smaller vocabulary, a GPU), instead of being killed by the kernel's OOM killer
a minute later with no message. ``trainer.memory_check=false`` turns the check off.

The estimate, per data-parallel rank (FSDP2 divides the first three lines by the world size):

- parameters, in FP32: 4 bytes each;
- gradients, in FP32: 4 bytes each;
- AdamW's two moments, in FP32: 8 bytes each;
- FP8 weight copies of the FP8 linears (the cached quantised weight in both orientations):
  2 bytes per FP8 parameter;
- activations kept for the backward pass, per token of a micro-batch and per layer:
  ``(10 · dim + 4 · ffn) ·`` the activation width (4 bytes in FP32, 2 under BF16 autocast); MoE
  layers count ``moe_top_k + shared`` experts of ``moe_ffn_dim`` as their ``ffn``;
- the loss: logits, their softmax and its gradient, FP32, ``3 · 4 · vocab`` bytes per token;
- on the CPU, the process itself (Python, PyTorch's libraries, the data pipeline): 0.75 GiB.

Checked on CPU against the peak resident memory of short runs (``llama3_150m`` with 4 layers:
1.95 GiB estimated, 1.87 GiB measured; ``llama3_8b`` shapes with 2 layers and a 512-token
vocabulary: 8.9 GiB estimated, 9.0 GiB measured under blockwise, 8.1 / 8.2 GiB under bf16).

It is deliberately simple (no allocator fragmentation, no temporary buffers of the GEMMs), so
it errs low: a run the check lets through can still run out of memory at the edge; a run it
refuses needs at least the memory it names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from ..models import ModelConfig

__all__ = ["MemoryEstimate", "estimate_training_memory", "available_memory", "check_fits", "format_bytes"]

GiB = 1024**3


def format_bytes(n: float) -> str:
    """``12.3 GiB`` / ``456 MiB``."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 1024**2:.0f} MiB"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank, by part (see the module docstring)."""

    parameters: float
    gradients: float
    optimizer: float
    fp8_weights: float
    activations: float
    loss: float
    runtime: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.parts().values())

    def parts(self) -> Dict[str, float]:
        return {
            "parameters (FP32)": self.parameters,
            "gradients (FP32)": self.gradients,
            "AdamW moments (FP32)": self.optimizer,
            "FP8 weight copies": self.fp8_weights,
            "activations": self.activations,
            "logits and loss": self.loss,
            "the process": self.runtime,
        }

    def describe(self) -> str:
        return ", ".join(f"{k} {format_bytes(v)}" for k, v in self.parts().items() if v)


def _fp8_params(mcfg: ModelConfig) -> int:
    """Parameters of the linears the default policy runs in FP8 (every transformer-layer GEMM but
    the router; embedding and output head stay BF16)."""
    return (
        mcfg.num_params(include_embedding=False)
        - mcfg.vocab_size * mcfg.dim
        - mcfg.dim
        - sum(
            2 * mcfg.dim + (mcfg.dim * mcfg.num_experts if mcfg.is_moe_layer(i) else 0) for i in range(mcfg.num_layers)
        )
    )


#: What the process itself holds on the CPU (Python, PyTorch's libraries, the data pipeline).
CPU_RUNTIME_BYTES = 0.75 * GiB


def estimate_training_memory(
    mcfg: ModelConfig,
    *,
    tokens_per_micro_batch: int,
    fp8: bool,
    activation_bytes: int,
    shard: int = 1,
    cpu: bool = True,
) -> MemoryEstimate:
    """The estimate of the module docstring for one rank. ``shard``: ranks that FSDP2 shards the
    parameters, gradients and optimizer state over (1 for DDP or one process); ``cpu``: count the
    process's own memory (on a GPU it is host memory, not the device's)."""
    n = mcfg.num_params()
    per_layer = 0
    for i in range(mcfg.num_layers):
        ffn = (mcfg.moe_top_k + mcfg.num_shared_experts) * mcfg.moe_ffn_dim if mcfg.is_moe_layer(i) else mcfg.ffn_dim
        per_layer += 10 * mcfg.dim + 4 * ffn
    t = tokens_per_micro_batch
    return MemoryEstimate(
        parameters=4.0 * n / shard,
        gradients=4.0 * n / shard,
        optimizer=8.0 * n / shard,
        fp8_weights=2.0 * _fp8_params(mcfg) if fp8 else 0.0,
        activations=float(activation_bytes) * t * per_layer,
        loss=12.0 * t * mcfg.vocab_size,
        runtime=CPU_RUNTIME_BYTES if cpu else 0.0,
    )


def _cgroup_limit() -> Optional[int]:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path, encoding="ascii").read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes this process can still allocate on ``device``: the GPU's free memory, or on the CPU
    the kernel's ``MemAvailable`` (capped by a cgroup limit); None when it cannot be read."""
    if device.type == "cuda":
        try:
            free, _ = torch.cuda.mem_get_info(device)
            return int(free)
        except Exception:  # noqa: BLE001 - no CUDA context: skip the check
            return None
    avail = None
    try:
        for line in open("/proc/meminfo", encoding="ascii"):
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    limit = _cgroup_limit()
    if limit is not None:
        try:
            used = int(open("/sys/fs/cgroup/memory.current", encoding="ascii").read().strip())
        except (OSError, ValueError):
            used = 0
        avail = min(avail, max(0, limit - used)) if avail is not None else max(0, limit - used)
    return avail


def _suggestions(mcfg: ModelConfig, available: int, **kw) -> List[str]:
    out = []
    for layers in range(mcfg.num_layers - 1, 0, -1):
        if estimate_training_memory(mcfg.replace(num_layers=layers), **kw).total <= available:
            out.append(
                f"model.num_layers={layers} (the same layer shapes, "
                f"{format_bytes(estimate_training_memory(mcfg.replace(num_layers=layers), **kw).total)})"
            )
            break
    if mcfg.vocab_size > 512:
        small = mcfg.replace(vocab_size=512)
        for layers in range(mcfg.num_layers, 0, -1):
            est = estimate_training_memory(small.replace(num_layers=layers), **kw).total
            if est <= available:
                out.append(
                    f"model.vocab_size=512 model.num_layers={layers} (the byte-level vocabulary drops the "
                    f"{mcfg.vocab_size}-entry embedding and head, {format_bytes(est)})"
                )
                break
    out.append("a smaller model (model=llama3_150m or model=llama3_tiny)")
    return out


def check_fits(
    mcfg: ModelConfig,
    device: torch.device,
    *,
    tokens_per_micro_batch: int,
    fp8: bool,
    activation_bytes: int,
    shard: int = 1,
    where: str = "",
    available: Optional[int] = None,
    device_name: Optional[str] = None,
) -> Optional[str]:
    """None if the run fits (or the free memory cannot be read); else the message to refuse it
    with: the estimate by part, the memory available, and what would fit. ``available`` (bytes)
    and ``device_name`` describe a device that is not this machine's (a cluster's GPU)."""
    avail = available_memory(device) if available is None else available
    if avail is None:
        return None
    kw = dict(
        tokens_per_micro_batch=tokens_per_micro_batch,
        fp8=fp8,
        activation_bytes=activation_bytes,
        shard=shard,
        cpu=device.type == "cpu",
    )
    est = estimate_training_memory(mcfg, **kw)
    if est.total <= avail:
        return None
    dev = device_name or ("this GPU" if device.type == "cuda" else "this machine")
    fixes = _suggestions(mcfg, avail, **kw)
    if device.type == "cpu":
        fixes.append("a GPU (trainer.device=cuda)")
    return (
        f"model={mcfg.name} ({mcfg.num_params() / 1e9:.2f}B parameters, {mcfg.num_layers} layers) needs about "
        f"{format_bytes(est.total)} to train{where}, and {dev} has {format_bytes(avail)} available "
        f"({est.describe()}). What fits: " + "; ".join(fixes) + ". trainer.memory_check=false skips this estimate"
    )
