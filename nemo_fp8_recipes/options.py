"""Kernel options of the native FP8 path: which kernels run, in one frozen object.

The native backend has a few switches that choose between kernels computing the same quantities
(fused or not, Triton or plain PyTorch). They are fields of :class:`KernelOptions`, passed to
:func:`~nemo_fp8_recipes.nn.convert_model` (or applied to a built model with
:func:`~nemo_fp8_recipes.nn.apply_kernel_options`), set for the trainer by its ``kernels`` config
group (``nemo-fp8-train kernels.fused_swiglu=false``), and recorded in the run's ``config.yaml``,
``audit.txt`` and ``summary.json``. Two change results, the rest only speed:

* ``fused_swiglu``: the gate's gradient of a fused SwiGLU may differ in its last bit;
* ``fused_norm``: the fused RMSNorm's backward is first-order only (a gradient penalty through it
  raises), its values are the formula's.

Defaults are all on. The environment variables of :data:`ENV` (``NEMO_FP8_TRITON=0``, ...) change
the defaults, read here only, when a model is converted or built; whatever they say, the
options a model runs with are the ones recorded.

The package reads ``NEMO_FP8_*`` variables here only: the kernel defaults above and two
:data:`SETTINGS_ENV` variables that change neither numerics nor kernels (the token cache
location, the process-group timeout), through :func:`env_setting`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Mapping, Optional

__all__ = ["ENV", "SETTINGS_ENV", "KernelOptions", "default_kernel_options", "env_setting"]

#: option -> the environment variable that changes its default
ENV = {
    "triton": "NEMO_FP8_TRITON",
    "fast_launch": "NEMO_FP8_FAST_LAUNCH",
    "shared_input": "NEMO_FP8_SHARED_INPUT",
    "fused_swiglu": "NEMO_FP8_FUSED_SWIGLU",
    "fused_norm": "NEMO_FP8_FUSED_NORM",
}
#: setting -> its environment variable (neither changes numerics or the kernel path)
SETTINGS_ENV = {
    "cache_dir": "NEMO_FP8_CACHE_DIR",  # token cache (nemo_fp8_recipes.data.default_cache_dir)
    "dist_timeout_min": "NEMO_FP8_DIST_TIMEOUT_MIN",  # torch.distributed process-group timeout, minutes
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the native FP8 path runs. Every field picks between kernels that compute the same
    codes and scales; only ``fused_swiglu`` can change a number (the gate gradient's last bit).

    Attributes:
        triton: the fused Triton quantisers and norm on CUDA; False runs the reference quantisers
            (plain PyTorch ops: eagerly one op at a time, under ``torch.compile`` generated and
            fused by Inductor) — bit-identical codes and scales, for debugging and A/B timing.
        fast_launch: launch the compiled Triton kernels directly instead of through Triton's
            ``kernel[grid](...)`` (the same kernels, less host time per launch). Process-wide:
            the launcher is shared by every model in the process.
        shared_input: eager FP8 linears that read the same tensor (q/k/v, gate/up) share one
            quantisation of it (the same codes, computed once).
        fused_swiglu: the down projection quantises ``silu(gate) * up`` in the quantiser's own
            pass and the SwiGLU backward is one kernel (forward bit-identical; the gate's
            gradient may differ in its last bit).
        fused_norm: RMSNorm in one Triton pass in eager mode, starting the next FP8 linears'
            input quantisation (values identical; backward first-order only).
    """

    triton: bool = True
    fast_launch: bool = True
    shared_input: bool = True
    fused_swiglu: bool = True
    fused_norm: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, bool):
                raise TypeError(f"KernelOptions.{f.name} must be True or False, got {v!r} ({type(v).__name__})")

    @classmethod
    def from_mapping(cls, values: Optional[Mapping[str, Any]] = None) -> "KernelOptions":
        """From a mapping (a Hydra/OmegaConf group, a dict): the default options
        (:func:`default_kernel_options`) with the given fields replaced; an unknown key is an
        error naming the valid ones."""
        base = default_kernel_options()
        values = dict(values or {})
        unknown = sorted(set(values) - set(base.as_dict()))
        if unknown:
            raise ValueError(f"unknown kernel option(s) {', '.join(unknown)}; valid: {', '.join(base.as_dict())}")
        return dataclasses.replace(base, **values)

    def replace(self, **changes: bool) -> "KernelOptions":
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> Dict[str, bool]:
        """``{field: value}`` in field order (what the run's config, audit and summary record)."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line: ``triton=on fast_launch=on ...``."""
        return " ".join(f"{k}={'on' if v else 'off'}" for k, v in self.as_dict().items())


def default_kernel_options(environ: Optional[Mapping[str, str]] = None) -> KernelOptions:
    """All options on, except where an environment variable of :data:`ENV` says ``0`` / ``false``
    (``1`` / ``true`` keep it on); another value is an error naming the variable."""
    env = os.environ if environ is None else environ
    values = {}
    for field, var in ENV.items():
        raw = env.get(var)
        if raw is None or raw.strip() == "":
            continue
        v = raw.strip().lower()
        if v not in _TRUE + _FALSE:
            raise ValueError(f"{var}={raw!r} is not valid; use 1 or 0 (it sets the default of KernelOptions.{field})")
        values[field] = v in _TRUE
    return KernelOptions(**values)


def env_setting(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The value of :data:`SETTINGS_ENV`'s variable for ``name``, or ``None`` when unset or empty."""
    if name not in SETTINGS_ENV:
        raise KeyError(f"unknown setting {name!r}; known: {', '.join(sorted(SETTINGS_ENV))}")
    raw = (os.environ if environ is None else environ).get(SETTINGS_ENV[name], "").strip()
    return raw or None
