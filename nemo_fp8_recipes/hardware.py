"""The GPUs this package knows by name: compute capability (which recipes run for real) and dense
datasheet peak TFLOP/s (MFU). One table for the validator (``--gpu h100``), the launchers and the
trainer's MFU. Also the description of one device (:class:`DeviceInfo`, :func:`describe_device`)
that the recipe hardware check (:func:`nemo_fp8_recipes.recipes.check_supported`) reads."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple, Union

import torch

from .versions import version_tuple

__all__ = [
    "GPU",
    "GPUS",
    "gpu_by_key",
    "gpu_by_device_name",
    "normalise_gpu_name",
    "DeviceInfo",
    "describe_device",
    "device_from_name",
]


@dataclass(frozen=True)
class GPU:
    """``key``: the name users type (``--gpu h100``); ``name``: the full product name;
    ``match``: the part of ``torch.cuda.get_device_name()`` that identifies it; ``peak_tflops``:
    dense datasheet peaks per precision (``bf16``, ``fp8``), empty where not listed;
    ``memory_gb``: the datasheet memory per GPU (10^9 bytes), None where a model comes in sizes."""

    key: str
    name: str
    capability: Tuple[int, int]
    match: str
    peak_tflops: Mapping[str, float] = field(default_factory=dict)
    memory_gb: Optional[float] = None


_HOPPER = {"bf16": 989.4, "fp8": 1978.9}

#: Most specific first: keys and device names are matched in this order (``gb200`` before
#: ``b200``, ``h100nvl`` before ``h100``, ``l40s`` before ``l4``).
GPUS: Tuple[GPU, ...] = (
    GPU("gb200", "NVIDIA GB200", (10, 0), "GB200", {"bf16": 2500.0, "fp8": 5000.0}),
    GPU("b200", "NVIDIA B200", (10, 0), "B200", {"bf16": 2250.0, "fp8": 4500.0}),
    GPU("gb300", "NVIDIA GB300", (10, 3), "GB300"),
    GPU("b300", "NVIDIA B300", (10, 3), "B300"),
    GPU("gh200", "NVIDIA GH200", (9, 0), "GH200", _HOPPER),
    GPU("h200", "NVIDIA H200", (9, 0), "H200", _HOPPER, 141.0),
    GPU("h100nvl", "NVIDIA H100 NVL", (9, 0), "H100 NVL", {"bf16": 835.0, "fp8": 1670.0}, 94.0),
    GPU("h100pcie", "NVIDIA H100 PCIe", (9, 0), "H100 PCIe", {"bf16": 756.0, "fp8": 1513.0}, 80.0),
    GPU("h100", "NVIDIA H100", (9, 0), "H100", _HOPPER, 80.0),  # SXM5
    GPU("h800", "NVIDIA H800", (9, 0), "H800", _HOPPER, 80.0),
    GPU("a100", "NVIDIA A100", (8, 0), "A100", {"bf16": 312.0}),
    GPU("l40s", "NVIDIA L40S", (8, 9), "L40S"),
    GPU("l4", "NVIDIA L4", (8, 9), "L4"),
    GPU("rtx5090", "NVIDIA RTX 5090", (12, 0), "RTX 5090"),
    GPU("rtxpro6000", "NVIDIA RTX PRO 6000", (12, 0), "RTX PRO 6000"),
)


def normalise_gpu_name(spec: str) -> str:
    """A user's GPU name with case, spaces, dashes, underscores and ``nvidia`` dropped
    (``NVIDIA H100-SXM5`` -> ``h100sxm5``)."""
    return str(spec).lower().replace("nvidia", "").replace("-", "").replace(" ", "").replace("_", "")


def gpu_by_key(spec: str) -> Optional[GPU]:
    """The GPU a user's name denotes (case, spaces, dashes, underscores and ``nvidia`` ignored, as
    :func:`normalise_gpu_name`), a suffix allowed (``H100-SXM5-80GB``, ``H100 80GB`` -> h100) that
    does not continue the model number (``h1000`` and ``l40`` are none of ours)."""
    raw = str(spec).lower().replace("nvidia", "")
    for g in GPUS:
        sep = r"[\s_-]*"
        if re.match(sep + sep.join(map(re.escape, g.key)) + r"(?:$|[\s_-]|(?![0-9]))", raw):
            return g
    return None


def gpu_by_device_name(name: str) -> Optional[GPU]:
    """The GPU that ``torch.cuda.get_device_name()`` reports (``NVIDIA H100 80GB HBM3``)."""
    return next((g for g in GPUS if g.match in name), None)


@dataclass(frozen=True)
class DeviceInfo:
    """What the hardware check needs to know about a device."""

    type: str  # "cpu" or "cuda"
    name: str = "CPU"
    capability: Optional[Tuple[int, int]] = None
    cuda_version: Optional[Tuple[int, int]] = None

    @property
    def sm(self) -> Optional[int]:
        return None if self.capability is None else self.capability[0] * 10 + self.capability[1]

    def __str__(self) -> str:
        if self.type == "cpu":
            return "CPU"
        return f"SM{self.sm} ({self.name})"


def device_from_name(spec: str, cuda_version: Optional[Tuple[int, int]] = None) -> Optional[DeviceInfo]:
    """A GPU the user names (``h100``, ``NVIDIA H200``, ``sm90``; :func:`gpu_by_key`) as a
    :class:`DeviceInfo` of a machine that is not this one; None if the name is no GPU's."""
    s = normalise_gpu_name(spec)
    m = re.fullmatch(r"sm(\d{2,3})", s)
    if m:
        sm = int(m.group(1))
        return DeviceInfo(type="cuda", name=f"SM{sm} GPU", capability=(sm // 10, sm % 10), cuda_version=cuda_version)
    gpu = gpu_by_key(spec)
    if gpu is not None:
        return DeviceInfo(type="cuda", name=gpu.name, capability=gpu.capability, cuda_version=cuda_version)
    return None


def describe_device(device: Union[None, str, torch.device, DeviceInfo] = None) -> DeviceInfo:
    """Resolve ``device`` (None = current CUDA device if available, else CPU; a torch device; or a
    GPU's name, ``h100`` / ``sm90``, for a machine that is not this one) into a
    :class:`DeviceInfo`. Does not initialise CUDA unless a CUDA device is asked for or CUDA
    is the default."""
    if isinstance(device, DeviceInfo):
        return device
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, str):
        try:
            torch.device(device)
        except RuntimeError:
            named = device_from_name(device)
            if named is None:
                raise ValueError(
                    f"unknown device {device!r}: give a torch device (cpu, cuda, cuda:1) or a GPU's name "
                    f"({', '.join(g.key for g in GPUS)}, or smNN such as sm90)"
                ) from None
            return named
    dev = torch.device(device)
    if dev.type != "cuda":
        return DeviceInfo(type=dev.type, name=dev.type.upper())
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    return DeviceInfo(
        type="cuda",
        name=torch.cuda.get_device_name(idx),
        capability=tuple(torch.cuda.get_device_capability(idx)),
        cuda_version=version_tuple(torch.version.cuda, width=2),
    )
