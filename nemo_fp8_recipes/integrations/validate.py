"""Pre-launch validation: ``nemo-fp8-check`` (CLI) and :func:`validate` (API).

Catches, before a job is queued, the FP8 set-ups that Megatron-Core, Megatron-Bridge or
Transformer Engine would reject late, or — worse — accept and silently change (docs/integration.md,
"Facts about the stack"):

======================  =====================================================================
code                    trap
======================  =====================================================================
delayed-first-last      delayed scaling + first/last BF16 layers (Megatron raises)
bf16-layers-per-stage   more BF16 layers than a pipeline stage holds (Megatron raises)
hardware                mxfp8 on Hopper or SM120, blockwise with CUDA < 12.9, no FP8 GPU
fp8-wgrad-noop          fp8_wgrad=False: ignored by TE >= 2.0 (wgrad still runs in FP8)
delayed-history-1       delayed scaling with Megatron's default amax history of 1
bridge-clobber          a model./optimizer./ddp. override that MixedPrecisionConfig.setup()
                        overwrites (the CLI value is silently lost)
bridge-conflict         a mixed_precision.* override that contradicts recipe= / policy.*
layer-dims              GEMM dims the recipe's FP8 GEMMs cannot take (16 / 128 / 32)
fp8-param-gather        fp8_param_gather without the distributed optimizer (or, for mxfp8,
                        without reuse_grad_buf_for_mxfp8_param_ag)
no-te                   backend te/megatron_bridge where TE is not importable: Megatron's
                        get_fp8_context returns nullcontext and fp8 is silently a no-op
...                     see :func:`validate` for the full list
======================  =====================================================================

Every message names the fix. The report prints the effective FP8 settings in a table.

CLI: Hydra overrides exactly like the trainer (``recipe=delayed policy.first_layers_bf16=1
backend=megatron_bridge model=llama3_8b``), framework overrides (``model.fp8_wgrad=false``,
``mixed_precision.fp8_param_gather=true``, ``ddp.use_distributed_optimizer=false``) and flags for
the target machine (``--gpu h100 --cuda 12.8 --te 2.9``). Exit status 0 = no error, 1 = errors,
2 = a bad configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ..policy import PrecisionPolicy
from ..recipes import DeviceInfo, Recipe, check_supported, describe_device, get_recipe
from .megatron import DELAYED_FIRST_LAST_MSG, megatron_config
from .te import (
    TE_MIN_AUTOCAST_VERSION,
    TEImportOrderError,
    TEUnsupportedError,
    check_te_import_order,
    te_available,
    te_recipe_spec,
)
from ..hardware import GPUS, gpu_by_key, normalise_gpu_name
from ..versions import version_tuple
from .te import te_version as _installed_te_version

__all__ = [
    "BACKENDS",
    "Finding",
    "ValidationReport",
    "ValidationError",
    "validate",
    "validate_config",
    "parse_gpu",
    "parse_overrides",
    "split_overrides",
    "main",
]

BACKENDS = ("native", "te", "megatron_bridge")

#: MixedPrecisionConfig fields of Megatron-Bridge 0.6.2 (src/megatron/bridge/training/
#: mixed_precision.py); ``setup()`` copies each onto every model/optimizer/DDP config that has a
#: field of the same name. Read from the real class when Bridge is importable.
BRIDGE_MIXED_PRECISION_FIELDS = (
    "fp32", "fp16", "bf16", "params_dtype", "pipeline_dtype", "autocast_dtype", "autocast_enabled",
    "grad_reduce_in_fp32", "fp8", "fp8_recipe", "first_last_layers_bf16", "fp8_margin",
    "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad", "fp8_dot_product_attention",
    "fp8_multi_head_attention", "fp8_param", "fp8_param_gather", "fp4", "fp4_recipe", "fp4_param",
    "fp4_param_gather", "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window",
    "hysteresis", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
    "reuse_grad_buf_for_mxfp8_param_ag",
)

#: The MixedPrecisionConfig fields our recipe + policy own (anything else may be overridden).
RECIPE_OWNED_FIELDS = (
    "fp8", "fp8_recipe", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo",
    "fp8_wgrad", "fp8_dot_product_attention", "fp8_multi_head_attention", "fp4",
)

#: Minimum TE version per recipe, as Megatron-Core's get_fp8_recipe() requires it.
_TE_MIN_FOR_RECIPE = {"delayed": (1, 0), "tensorwise": (2, 2), "blockwise": (2, 3), "mxfp8": (2, 1)}

class ValidationError(ValueError):
    """Raised by :meth:`ValidationReport.raise_for_errors`; the message lists every error."""


@dataclass(frozen=True)
class Finding:
    """One problem: ``level`` is ``error`` (the run would fail or silently misbehave) or
    ``warning`` (works, but probably not what you want); ``code`` is stable for tests/tools."""

    level: str
    code: str
    message: str


@dataclass
class ValidationReport:
    """What :func:`validate` found, and the effective FP8 settings (setting, value, source)."""

    recipe: str
    backend: str
    target: str
    settings: List[Tuple[str, str, str]] = field(default_factory=list)
    findings: List[Finding] = field(default_factory=list)

    @property
    def errors(self) -> List[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> List[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    @property
    def ok(self) -> bool:
        """True when there is no error (warnings allowed)."""
        return not self.errors

    def codes(self, level: Optional[str] = None) -> List[str]:
        """Finding codes, optionally of one level."""
        return [f.code for f in self.findings if level is None or f.level == level]

    def table(self) -> str:
        """The effective settings as a fixed-width table, then the findings."""
        hdr = ("setting", "value", "from")
        short = [r for r in self.settings if len(str(r[1])) <= 64]
        long = [r for r in self.settings if len(str(r[1])) > 64]
        rows = [hdr] + [tuple(str(c) for c in r) for r in short]
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"FP8 settings: recipe {self.recipe} | backend {self.backend} | target {self.target}"]
        lines.append("  ".join(h.ljust(w[i]) for i, h in enumerate(hdr)).rstrip())
        lines.append("  ".join("-" * x for x in w))
        for r in rows[1:]:
            lines.append("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip())
        for name, value, src in long:
            lines.append(f"{name} ({src}): {value}")
        if self.findings:
            lines.append("")
            for f in self.findings:
                lines.append(f"{f.level.upper()} [{f.code}] {f.message}")
        lines.append("")
        lines.append(f"{len(self.errors)} error(s), {len(self.warnings)} warning(s)"
                     + ("" if self.errors else ": OK to launch"))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe, "backend": self.backend, "target": self.target, "ok": self.ok,
            "settings": [list(r) for r in self.settings],
            "findings": [dataclasses.asdict(f) for f in self.findings],
        }

    def raise_for_errors(self) -> "ValidationReport":
        """Raise :class:`ValidationError` listing every error; returns self when there is none."""
        if self.errors:
            raise ValidationError(
                f"{len(self.errors)} FP8 configuration error(s):\n"
                + "\n".join(f"- [{f.code}] {f.message}" for f in self.errors)
            )
        return self


# ---- helpers ------------------------------------------------------------------------------------
def parse_gpu(spec: Union[None, str, DeviceInfo], cuda: Optional[str] = None) -> DeviceInfo:
    """A target device from a name: ``h100``/``h200`` (SM90), ``b200``/``gb200`` (SM100),
    ``b300`` (SM103), ``rtx5090`` (SM120), ``a100``, ``l40s``, ``smNN``, ``cpu``; ``None`` or
    ``auto`` = this machine. ``cuda`` = the CUDA version there (``12.8``)."""
    if isinstance(spec, DeviceInfo):
        return spec
    cv = None
    if cuda is not None and str(cuda) != "":
        m = re.fullmatch(r"(\d+)(?:\.(\d+))?(?:\.\d+)?", str(cuda).strip())
        if not m or int(m.group(1)) < 1:
            raise ValueError(f"--cuda {cuda!r} is not a CUDA version like 12.8 (major >= 1)")
        cv = (int(m.group(1)), int(m.group(2) or 0))
    if spec is None or str(spec).lower() in ("", "auto", "local"):
        info = describe_device()
        if cv is not None and info.type == "cuda":
            info = dataclasses.replace(info, cuda_version=cv)
        return info
    s = normalise_gpu_name(spec)
    if s == "cpu":
        return DeviceInfo(type="cpu")
    m = re.fullmatch(r"sm(\d{2,3})", s)
    if m:
        sm = int(m.group(1))
        return DeviceInfo(type="cuda", name=f"SM{sm} GPU", capability=(sm // 10, sm % 10), cuda_version=cv)
    gpu = gpu_by_key(s)
    if gpu is not None:
        return DeviceInfo(type="cuda", name=gpu.name, capability=gpu.capability, cuda_version=cv)
    raise ValueError(f"unknown GPU {spec!r}; use one of: {', '.join(g.key for g in GPUS)}, smNN (e.g. sm90) or cpu")


def _parse_value(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def parse_overrides(overrides: Iterable[str]) -> Dict[str, Any]:
    """``["model.fp8_wgrad=false", "ddp.use_distributed_optimizer=true"]`` -> ``{"model.fp8_wgrad":
    False, ...}`` (``+``/``++`` prefixes dropped; ``~key`` deletions ignored)."""
    out: Dict[str, Any] = {}
    for o in overrides:
        o = str(o).strip()
        if not o or o.startswith("~") or "=" not in o:
            continue
        k, v = o.split("=", 1)
        out[k.lstrip("+")] = _parse_value(v)
    return out


_OUR_PREFIXES = ("recipe", "policy", "backend", "trainer", "run", "data", "cluster", "hydra", "submit")


def split_overrides(args: Sequence[str], backend: Optional[str] = None) -> Tuple[List[str], List[str]]:
    """Split command-line overrides into ours (the Hydra config tree of ``nemo-fp8-train``) and
    the framework's (Megatron ``TransformerConfig`` / Megatron-Bridge ``ConfigContainer``).

    Ours: the groups (``recipe=``, ``model=``, ``backend=``, ``cluster=``, ``data=``), and keys
    under ``recipe. policy. backend. trainer. run. data. cluster. hydra. submit.``; ``model.<field>``
    too when ``<field>`` is one of our model-config fields and the model is ours to build (any
    backend but ``megatron_bridge``, and ``megatron_bridge`` with ``backend.provider`` resolving to
    ``ours``). Everything else (``train.*``, ``optimizer.*``, ``mixed_precision.*``,
    ``ddp.*``, Megatron ``model.*`` fields, ...) belongs to the framework.
    """
    from ..models import ModelConfig

    if backend is None:
        backend = next((a.split("=", 1)[1] for a in args if a.split("=", 1)[0].lstrip("+") == "backend"), "native")
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)} | {"optim"}
    our_model_fields = backend != "megatron_bridge" or _bridge_builds_our_model(args)
    ours, theirs = [], []
    for a in args:
        key = a.split("=", 1)[0].lstrip("+~")
        head, _, rest = key.partition(".")
        if head in _OUR_PREFIXES or (head == "model" and not rest):
            ours.append(a)
        elif head == "model" and our_model_fields and rest.split(".")[0] in model_fields:
            ours.append(a)
        else:
            theirs.append(a)
    return ours, theirs


def _default_model() -> str:
    from ..train_config import compose_config

    return str(compose_config([]).model.name)


def _bridge_builds_our_model(args: Sequence[str]) -> bool:
    """Whether a Megatron-Bridge launch builds the model from our config (``backend.provider``),
    so that ``model.<our field>`` overrides are ours; else they are the Bridge provider's."""
    from .bridge_recipes import BridgeLaunchError, provider_mode

    def value(key: str, default=None):
        return next((a.split("=", 1)[1] for a in args if a.split("=", 1)[0].lstrip("+") == key), default)

    try:
        return provider_mode(value("model") or _default_model(), value("backend.provider", "auto"),
                             value("backend.recipe_fn") if value("backend.recipe_fn") not in (None, "null") else None
                             ) == "ours"
    except BridgeLaunchError:
        return False  # the launcher reports the bad value


def _model_dims(model: Any) -> Dict[str, Optional[int]]:
    """Normalise a model description (our ModelConfig / dict, or Megatron TransformerConfig
    names) into the dims the GEMM check needs."""
    if model is None:
        return {}
    get = (lambda k: model.get(k)) if isinstance(model, Mapping) else (lambda k: getattr(model, k, None))

    def first(*keys):
        for k in keys:
            v = get(k)
            if v is not None:
                return v
        return None

    d = {
        "hidden": first("hidden_size", "dim"),
        "ffn": first("ffn_hidden_size", "ffn_dim"),
        "heads": first("num_attention_heads", "num_heads"),
        "kv_heads": first("num_query_groups", "num_kv_heads"),
        "head_dim": first("kv_channels", "head_dim"),
        "layers": first("num_layers"),
        "experts": first("num_moe_experts", "num_experts"),
        "moe_ffn": first("moe_ffn_hidden_size", "moe_ffn_dim"),
        "gated": first("gated_linear_unit"),
        "arch": first("arch"),
    }
    if d["hidden"] and d["heads"] and not d["head_dim"]:
        d["head_dim"] = d["hidden"] // d["heads"]
    if d["kv_heads"] is None:
        d["kv_heads"] = d["heads"]
    if d["gated"] is None:
        d["gated"] = d["arch"] in ("llama", "moe") or d["arch"] is None and d["ffn"] is not None
    return d


def _gemm_shapes(d: Dict[str, Any]) -> List[Tuple[str, int, int]]:
    """``(module pattern, out_features, in_features)`` of the FP8 GEMMs of one layer."""
    h, ffn, heads, kv, hd = d.get("hidden"), d.get("ffn"), d.get("heads"), d.get("kv_heads"), d.get("head_dim")
    shapes = []
    if h and heads and hd:
        shapes.append(("*.self_attention.linear_qkv", (heads + 2 * (kv or heads)) * hd, h))
        shapes.append(("*.self_attention.linear_proj", h, heads * hd))
    mult = 2 if d.get("gated") else 1
    if h and ffn:
        shapes.append(("*.mlp.linear_fc1", mult * ffn, h))
        shapes.append(("*.mlp.linear_fc2", h, ffn))
    if h and d.get("experts") and d.get("moe_ffn"):
        shapes.append(("*.mlp.experts.*linear_fc1", mult * d["moe_ffn"], h))
        shapes.append(("*.mlp.experts.*linear_fc2", h, d["moe_ffn"]))
    return shapes


def _bridge_mp_fields() -> Tuple[str, ...]:
    try:
        from megatron.bridge.training.mixed_precision import MixedPrecisionConfig  # type: ignore

        return tuple(f.name for f in dataclasses.fields(MixedPrecisionConfig))
    except Exception:  # noqa: BLE001 - Bridge absent (Python < 3.12 here): the 0.6.2 list
        return BRIDGE_MIXED_PRECISION_FIELDS


# ---- the checks ---------------------------------------------------------------------------------
def validate(
    recipe: Union[str, Recipe],
    policy: Optional[PrecisionPolicy] = None,
    *,
    backend: str = "te",
    model: Any = None,
    device: Union[None, str, DeviceInfo] = None,
    te_version: Union[None, str, Sequence[int]] = "auto",
    overrides: Union[None, Sequence[str], Mapping[str, Any]] = None,
    pipeline_model_parallel_size: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    seq_len: Optional[int] = None,
    fp8_param_gather: bool = False,
    environ: Optional[Mapping[str, str]] = None,
) -> ValidationReport:
    """Check ``recipe`` + ``policy`` for ``backend`` before launch; returns a :class:`ValidationReport`.

    Args:
        recipe / policy: registry key or :class:`Recipe`; :class:`PrecisionPolicy` (default policy).
        backend: ``native`` (our FP8 linear, plain PyTorch or the Megatron swap), ``te``
            (Megatron-Core + Transformer Engine) or ``megatron_bridge``.
        model: dims, as our model config (``dim, ffn_dim, num_heads, num_kv_heads, num_layers,
            num_experts, moe_ffn_dim``) or Megatron names (``hidden_size, ffn_hidden_size,
            num_attention_heads, num_query_groups, kv_channels, num_moe_experts, ...``).
        device: the target GPU (``"h100"``, ``"b200"``, ``"sm90"``, a :class:`DeviceInfo`); None =
            this machine.
        te_version: TE version on the target (``"2.9"``); ``"auto"`` = the one installed here.
        overrides: framework overrides as given on the command line (``model.fp8_wgrad=false``,
            ``mixed_precision.fp8_param_gather=true``, ``ddp.use_distributed_optimizer=false``) or
            a mapping of the same keys. For ``te`` the ``model.*`` keys are TransformerConfig
            fields.
        pipeline_model_parallel_size / micro_batch_size / seq_len: for the layer and token checks
            (read from ``model.pipeline_model_parallel_size`` / ``train.micro_batch_size``
            overrides when not given).
        fp8_param_gather: what our Bridge launcher sets (``backend.fp8_param_gather``).
        environ: the environment the job will start with (default: this process's).
    """
    r = recipe if isinstance(recipe, Recipe) else get_recipe(recipe)
    p = policy or PrecisionPolicy()
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not valid; choose one of: {', '.join(BACKENDS)}")
    env = dict(os.environ if environ is None else environ)
    ov = dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(overrides or ())
    target = parse_gpu(device)
    rep = ValidationReport(recipe=r.name, backend=backend, target=str(target))
    add = lambda level, code, msg: rep.findings.append(Finding(level, code, msg))  # noqa: E731
    dims = _model_dims(model)
    for src, dst in (("hidden_size", "hidden"), ("ffn_hidden_size", "ffn"), ("num_attention_heads", "heads"),
                     ("num_query_groups", "kv_heads"), ("kv_channels", "head_dim"), ("num_layers", "layers"),
                     ("num_moe_experts", "experts"), ("moe_ffn_hidden_size", "moe_ffn")):
        if f"model.{src}" in ov and ov[f"model.{src}"] is not None:
            dims[dst] = ov[f"model.{src}"]
    pp = pipeline_model_parallel_size or ov.get("model.pipeline_model_parallel_size") or 1
    mbs = micro_batch_size or ov.get("train.micro_batch_size")
    seq = seq_len or ov.get("model.seq_length") or ov.get("dataset.seq_length")
    num_layers = dims.get("layers")
    te_backend = backend in ("te", "megatron_bridge")

    # -- recipe knobs the backend cannot express
    if te_backend and r.is_fp8:
        try:
            te_recipe_spec(r)
            megatron_config(r, PrecisionPolicy())  # Megatron-expressibility (policy checked below)
        except TEUnsupportedError as e:
            add("error", "te-unexpressible", str(e))

    # -- hardware (docs/recipes.md, "Hardware support")
    if r.is_fp8:
        if target.type != "cuda":
            if te_backend:
                add("warning", "hardware",
                    f"no GPU target given and {target} has none: the hardware checks were skipped; pass "
                    "--gpu h100 (or b200, sm90, ...) and --cuda 12.9 for the cluster you will run on")
            else:
                ok, why = check_supported(r, target)
                if not ok:
                    add("error", "hardware", why)
        else:
            probe = r.replace(emulate=None) if te_backend else r
            ok, why = check_supported(probe, target)
            if te_backend and not ok:
                why = re.sub(r",? or emulate=true( for numerics only)?", "", why)
                why += " (recipe.emulate=true exists only on backend=native: Transformer Engine does not emulate)"
            if not ok:
                add("error", "hardware", why)
            if target.sm == 90 and r.name == "blockwise" and target.cuda_version is None:
                add("warning", "hardware",
                    "blockwise on Hopper needs CUDA >= 12.9 for its 1x128/128x128 GEMMs; pass --cuda to check it")

    # -- first/last layers
    first, last = p.first_layers_bf16, p.last_layers_bf16
    mp_first_last = ov.get("mixed_precision.first_last_layers_bf16", ov.get("model.first_last_layers_bf16"))
    if te_backend and r.is_delayed and (first or last or mp_first_last):
        add("error", "delayed-first-last", DELAYED_FIRST_LAST_MSG)
    if num_layers:
        per_stage = num_layers // max(1, int(pp))
        for label, n in (("first_layers_bf16", first), ("last_layers_bf16", last)):
            if n > per_stage and te_backend:
                add("error", "bf16-layers-per-stage",
                    f"policy.{label}={n} exceeds the {per_stage} layers per pipeline stage (num_layers="
                    f"{num_layers}, pipeline parallel {pp}); Megatron-Core allows at most that many. Lower it")
        if first + last >= num_layers and r.is_fp8:
            add("warning", "all-layers-bf16",
                f"policy keeps the first {first} and last {last} of {num_layers} layers in BF16: no FP8 GEMM "
                "is left; lower policy.first_layers_bf16/last_layers_bf16")
    if p.exclude and int(pp) > 1 and any(re.search(r"layers\.\d", x) for x in p.exclude) and te_backend:
        add("warning", "pp-layer-patterns",
            f"policy.exclude {list(p.exclude)} names layer indices, but Megatron matches them against the "
            f"local module path of each of the {pp} pipeline stages; use policy.first_layers_bf16/"
            "last_layers_bf16 for global indices, or patterns without layer numbers")
    if p.include and te_backend:
        add("warning", "policy-include-te",
            "policy.include has no effect with Transformer Engine (TE modules already run in FP8 inside the "
            "autocast; Megatron's output layer and router are not TE modules); drop it or use backend=native")

    # -- effective Megatron/Bridge values and the traps in them
    def eff(name: str, ours: Any) -> Tuple[Any, str]:
        for key in (f"mixed_precision.{name}", f"model.{name}"):
            if key in ov:
                return ov[key], f"override {key}"
        return ours, "recipe/policy"

    if te_backend and r.is_fp8:
        mp_fields = set(_bridge_mp_fields())
        if backend == "megatron_bridge":
            for key in ov:
                head, _, leaf = key.partition(".")
                if head in ("model", "optimizer", "ddp") and leaf in mp_fields:
                    add("error", "bridge-clobber",
                        f"{key}={ov[key]!r} would be silently overwritten: Megatron-Bridge's "
                        f"MixedPrecisionConfig.setup() copies mixed_precision.{leaf} onto the {head} config "
                        "at launch. " + (f"Set it with recipe=/policy.* (it is part of the FP8 recipe)"
                                         if leaf in RECIPE_OWNED_FIELDS else f"Use mixed_precision.{leaf}={ov[key]} instead"))
            if "mixed_precision" in ov:
                add("error", "bridge-conflict",
                    f"mixed_precision={ov['mixed_precision']!r} replaces the MixedPrecisionConfig built from "
                    f"recipe={r.name}; choose the recipe with recipe=<key> (and tune it with recipe.* / policy.*)")
        try:
            want = megatron_config(r, PrecisionPolicy(first_layers_bf16=first, last_layers_bf16=last)
                                   if not (r.is_delayed and (first or last)) else PrecisionPolicy())
        except (TEUnsupportedError, ValueError):
            want = None
        if want is not None:
            for name in RECIPE_OWNED_FIELDS:
                key = f"mixed_precision.{name}" if backend == "megatron_bridge" else f"model.{name}"
                if key in ov and name in want and ov[key] != want[name] and name not in (
                        "fp8_wgrad", "fp8_amax_history_len", "fp8_dot_product_attention", "fp8_multi_head_attention"):
                    add("error", "bridge-conflict" if backend == "megatron_bridge" else "recipe-conflict",
                        f"{key}={ov[key]!r} contradicts recipe={r.name} / policy (which set {name}={want[name]!r}); "
                        f"drop the override and choose it through recipe=<key>, recipe.* or policy.*")
        wgrad, src = eff("fp8_wgrad", True)
        if wgrad is False:
            add("error", "fp8-wgrad-noop",
                f"fp8_wgrad=False ({src}) is silently ignored by Transformer Engine >= 2.0: the wgrad GEMM "
                "still runs in FP8. Remove the override; to keep a layer's GEMMs in BF16 use "
                "policy.exclude=[<module pattern>]")
        for name in ("fp8_dot_product_attention", "fp8_multi_head_attention"):
            v, src = eff(name, False)
            if v:
                add("error", "attention-fp8",
                    f"{name}=True ({src}) puts the attention core in FP8, which the precision policy keeps in "
                    "BF16; remove the override")
        if r.is_delayed:
            hist, src = eff("fp8_amax_history_len", r.amax_history_len)
            algo, src_a = eff("fp8_amax_compute_algo", r.amax_compute_algo)
            if hist == 1 and src.startswith("override"):
                add("error", "delayed-history-1",
                    f"delayed scaling with fp8_amax_history_len=1 ({src}): Megatron's default history of 1 "
                    "with most_recent makes every scale follow a single step's amax (no headroom after a "
                    "spike). Remove the override to keep the recipe's history "
                    f"({r.amax_history_len}/{r.amax_compute_algo}), or set recipe.amax_history_len=1 on purpose")
            elif hist == 1:
                add("warning", "delayed-history-1",
                    "recipe.amax_history_len=1 is Megatron's default, not TE's (1024 / max): each scale follows "
                    "a single step's amax; set recipe.amax_history_len=1024 recipe.amax_compute_algo=max unless "
                    "you mean it")
        router, src = eff("moe_router_dtype", "fp32")
        if router not in ("fp32", "fp64") and (dims.get("experts") or "model.moe_router_dtype" in ov):
            add("error", "router-dtype",
                f"moe_router_dtype={router!r} ({src}): the policy keeps MoE gating in FP32; remove the override "
                "(our config sets fp32)")
        impl = ov.get("model.transformer_impl")
        if impl is not None and impl != "transformer_engine":
            add("error", "local-spec-fp8",
                f"model.transformer_impl={impl!r}: Megatron's get_fp8_context only enters an FP8 autocast for "
                "Transformer Engine layers, so fp8 would be a silent no-op; use transformer_impl="
                "transformer_engine, or backend=native (convert_megatron_model) for FP8 without TE")

        # fp8_param_gather
        fpg = ov.get("mixed_precision.fp8_param_gather", ov.get("model.fp8_param",
                     ov.get("mixed_precision.fp8_param", fp8_param_gather)))
        dist_opt = ov.get("ddp.use_distributed_optimizer", ov.get("optimizer.use_distributed_optimizer"))
        if backend == "megatron_bridge" and dist_opt is None:
            dist_opt = True  # the Llama / DeepSeek-V3 pretrain recipes turn it on
        if fpg and dist_opt is False:
            add("error", "fp8-param-gather",
                "fp8_param_gather=True keeps FP8 weight copies and all-gathers them in FP8, which needs "
                "Megatron's distributed optimizer; set ddp.use_distributed_optimizer=true, or drop "
                "fp8_param_gather")
        elif fpg and dist_opt is None:
            add("warning", "fp8-param-gather",
                "fp8_param_gather / fp8_param needs the distributed optimizer (--use-distributed-optimizer); "
                "make sure it is on")
        if fpg and r.name == "mxfp8" and not ov.get("mixed_precision.reuse_grad_buf_for_mxfp8_param_ag",
                                                      fp8_param_gather and backend == "megatron_bridge"):
            add("error", "fp8-param-gather",
                "mxfp8 with fp8_param_gather needs reuse_grad_buf_for_mxfp8_param_ag=True (Megatron-Bridge "
                "asserts it); set mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=true")

    # -- Transformer Engine presence, version, environment
    if te_backend and r.is_fp8:
        installed, why = te_available()
        tev = _installed_te_version() if te_version == "auto" else version_tuple(te_version)
        if not installed and te_version == "auto":
            add("warning", "no-te",
                f"{why}. Without it Megatron's get_fp8_context() returns nullcontext and fp8 is silently a "
                "no-op (the local spec has no FP8 layers): install TE >= 2.9 where the job runs (this check "
                "can run without it), or use backend=native (convert_megatron_model) for FP8 without TE")
            if dims.get("experts"):
                add("warning", "moe-fp8-no-te",
                    "MoE + fp8: megatron-core validates the TE version in TransformerConfig.__post_init__ "
                    "and, without TE, fails with TypeError ('>=' between NoneType and Version); build the "
                    "config where TE is installed, or with megatron_config(..., backend='native')")
        if tev is not None:
            need = _TE_MIN_FOR_RECIPE.get(r.name, (2, 0))
            if tev < need:
                add("error", "te-version",
                    f"recipe {r.name} needs Transformer Engine >= {'.'.join(map(str, need))} in Megatron-Core; "
                    f"found {'.'.join(map(str, tev))}. Upgrade TE (>= 2.9 recommended)")
            elif tev < TE_MIN_AUTOCAST_VERSION:
                add("warning", "te-version",
                    f"Transformer Engine {'.'.join(map(str, tev))} predates te.autocast (2.9): the deprecated "
                    "fp8_autocast is used; upgrade to >= 2.9")
        try:
            spec = te_recipe_spec(r)
        except TEUnsupportedError:
            spec = None
        if spec is not None:
            for var, val in spec.env.items():
                if var in env and env[var] != val:
                    add("error", "nvte-env",
                        f"{var}={env[var]} is exported, but recipe {r.name} (scale_rounding="
                        f"{r.scale_rounding.value}) needs {var}={val}; TE reads it once at import. Unset it (the "
                        f"launcher sets it) or choose recipe.scale_rounding to match")
            try:
                check_te_import_order(r)
            except TEImportOrderError as e:
                add("error", "te-import-order", str(e))

    # -- GEMM shapes
    if r.is_fp8:
        a = r.gemm_alignment
        excluded = list(p.exclude)
        for pat, n_out, n_in in _gemm_shapes(dims):
            if p.attention_projections == "bf16" and "self_attention" in pat:
                continue
            bad = [f"{k}={v}" for k, v in (("out_features", n_out), ("in_features", n_in)) if v % a]
            if not bad:
                continue
            if any(_pat_covers(x, pat) for x in excluded):
                continue
            leaf = pat.rsplit(".", 1)[-1]
            if te_backend:
                add("error", "layer-dims",
                    f"{pat}: {', '.join(bad)} not divisible by {a} as {r.name} FP8 GEMMs need; keep it in BF16 "
                    f"with policy.exclude=['{pat}'], pad the dim to a multiple of {a}, or use a recipe with a "
                    f"smaller alignment (tensorwise: 16)")
            else:
                add("warning", "layer-dims",
                    f"{leaf}: {', '.join(bad)} not divisible by {a}: the policy keeps it in BF16 (reason recorded "
                    f"in the audit); pad the dim to a multiple of {a} to run it in FP8")
        if te_backend and mbs and seq:
            need_m = 32 if r.name == "mxfp8" else 16
            if (int(mbs) * int(seq)) % need_m:
                add("warning", "token-dims",
                    f"micro_batch_size x seq_length = {int(mbs) * int(seq)} tokens is not a multiple of {need_m}; "
                    "Transformer Engine's FP8 GEMMs need it; pad the sequence length")

    rep.settings = _settings_rows(r, p, backend, target, ov, fp8_param_gather)
    return rep


def _pat_covers(user_pattern: str, module_pattern: str) -> bool:
    """Whether a user exclude pattern keeps every module matching ``module_pattern`` in BF16
    (checked on a representative module name)."""
    import fnmatch

    sample = module_pattern.replace("*.", "decoder.layers.0.").replace("*", "local_experts.0.")
    return fnmatch.fnmatchcase(sample, user_pattern)


def _settings_rows(r: Recipe, p: PrecisionPolicy, backend: str, target: DeviceInfo, ov: Mapping[str, Any],
                   fp8_param_gather: bool) -> List[Tuple[str, str, str]]:
    rows: List[Tuple[str, str, str]] = []
    if backend == "native" or not r.is_fp8:
        for k, v in r.describe().items():
            if k != "name":
                rows.append((f"recipe.{k}", str(v), "recipe"))
        from ..recipes import uses_real_fp8_gemm

        if r.is_fp8 and target.type == "cuda":
            rows.append(("GEMMs", "real FP8" if uses_real_fp8_gemm(r, target) else "emulated", str(target)))
    else:
        safe_policy = p if not (r.is_delayed and (p.first_layers_bf16 or p.last_layers_bf16)) else PrecisionPolicy()
        try:
            mc = megatron_config(r, safe_policy)
        except (TEUnsupportedError, ValueError) as e:
            rows.append(("megatron_config", "refused", str(e).split(";")[0]))
            mc = None
        if mc is not None:
            for k, v in mc.items():
                src = "recipe" if k.startswith("fp8") else "policy"
                for key in (f"mixed_precision.{k}", f"model.{k}"):
                    if key in ov:
                        v, src = ov[key], f"override {key}"
                        break
                rows.append((k, str(v), src))
            if mc.te_precision_config is not None:
                rows.append(("te_precision_config", f"{len(mc.te_precision_config['matchers'])} BF16 matcher(s)", "policy"))
            for var, val in mc.env.items():
                rows.append((var, val, "recipe scale_rounding"))
            try:
                rows.append(("TE recipe", te_recipe_spec(r).describe().split(" [env")[0], "to_te_recipe"))
            except TEUnsupportedError:
                pass
        if backend == "megatron_bridge":
            fpg = ov.get("mixed_precision.fp8_param_gather", fp8_param_gather)
            rows.append(("fp8_param_gather", str(fpg), "override" if "mixed_precision.fp8_param_gather" in ov else "backend"))
            rows.append(("bf16 / params_dtype", "True / torch.bfloat16", "mixed_precision"))
    rows.append(("policy.attention_projections", p.attention_projections, "policy"))
    rows.append(("policy.first/last_layers_bf16", f"{p.first_layers_bf16}/{p.last_layers_bf16}", "policy"))
    if p.exclude:
        rows.append(("policy.exclude", ",".join(p.exclude), "policy"))
    rows.append(("kept out of FP8 by role", "embedding, output, router (fp32), norms, attention core", "policy"))
    return rows


def validate_config(cfg, framework_overrides: Sequence[str] = (), *, device=None, te_version="auto",
                    environ=None, backend: Optional[str] = None) -> ValidationReport:
    """:func:`validate` for a composed ``nemo-fp8-train`` config (``DictConfig``) plus framework
    overrides (the arguments :func:`split_overrides` did not claim)."""
    from omegaconf import OmegaConf

    from ..train_config import build_policy, build_recipe

    r = build_recipe(cfg.recipe)
    p = build_policy(cfg.get("policy"))
    backend = backend or str(cfg.backend.name)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if backend == "megatron_bridge" and cfg.backend.get("recipe_fn"):
        model = None  # the Bridge recipe function defines the model; our model= dims do not apply
    tr = cfg.get("trainer")
    mbs = tr.micro_batch_size if tr is not None and backend == "native" else None
    seq = tr.seq_len if tr is not None and backend == "native" else None
    fpg = bool(cfg.backend.get("fp8_param_gather", False)) if backend == "megatron_bridge" else False
    if backend == "native" and framework_overrides:
        raise ValueError(
            f"backend=native takes no framework overrides, got {list(framework_overrides)}; these keys belong "
            "to backend=te or backend=megatron_bridge"
        )
    return validate(r, p, backend=backend, model=model, device=device, te_version=te_version,
                    overrides=list(framework_overrides), micro_batch_size=mbs, seq_len=seq,
                    fp8_param_gather=fpg, environ=environ)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``nemo-fp8-check [--gpu h100] [--cuda 12.9] [--te 2.9] [--json out.json] [--strict]
    <hydra overrides> <framework overrides>``."""
    from ..train_config import validate_overrides

    parser = argparse.ArgumentParser(
        prog="nemo-fp8-check",
        description="Check an FP8 configuration before launch. Arguments without '--' are Hydra overrides "
                    "(as for nemo-fp8-train: recipe=, policy.*, model=, backend=) and framework overrides "
                    "(model.<TransformerConfig field>=, mixed_precision.*=, ddp.*=, train.*=).",
    )
    parser.add_argument("--gpu", default=None, help="target GPU: h100, h200, b200, gb200, b300, rtx5090, smNN, cpu "
                                                    "(default: this machine)")
    parser.add_argument("--cuda", default=None, help="CUDA version on the target, e.g. 12.9")
    parser.add_argument("--te", default="auto", help="Transformer Engine version on the target (default: installed here)")
    parser.add_argument("--json", default=None, help="also write the report as JSON to this path")
    parser.add_argument("--strict", action="store_true", help="treat warnings as errors")
    parser.add_argument("--megatron", action="store_true",
                        help="check for plain Megatron-Core / Megatron-LM with Transformer Engine (backend te); "
                             "model.<field>= overrides are then TransformerConfig fields")
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    flags = [a for a in rest if a.startswith("-")]
    if flags:
        print(f"nemo-fp8-check: unknown option(s) {flags}; see --help", file=sys.stderr)
        return 2
    if args.te != "auto" and not re.fullmatch(r"\d+(\.\d+){0,3}([.+-]?[A-Za-z0-9.+-]*)?", str(args.te)):
        print(f"nemo-fp8-check: --te {args.te!r} is not a Transformer Engine version like 2.9 or 2.20.2 "
              "(or auto: the one installed here)", file=sys.stderr)
        return 2
    if args.json:
        parent = Path(args.json).expanduser().resolve().parent
        if not parent.is_dir():
            print(f"nemo-fp8-check: --json {args.json}: the directory {parent} does not exist; create it "
                  f"(mkdir -p {parent}) or write the report elsewhere", file=sys.stderr)
            return 2
        if Path(args.json).is_dir():
            print(f"nemo-fp8-check: --json {args.json} is a directory; give a file name (e.g. "
                  f"{Path(args.json) / 'check.json'})", file=sys.stderr)
            return 2
    backend = "te" if args.megatron else None
    ours, theirs = split_overrides(rest, backend=backend)
    problem = validate_overrides(ours)
    if problem:
        print(f"nemo-fp8-check: {problem}", file=sys.stderr)
        return 2
    from ..train_config import compose_config

    cfg = compose_config(ours)
    try:
        target = parse_gpu(args.gpu, args.cuda)
        rep = validate_config(cfg, theirs, device=target, te_version=args.te, backend=backend)
    except ValueError as e:
        print(f"nemo-fp8-check: {e}", file=sys.stderr)
        return 2
    print(rep.table())
    if args.json:
        out = Path(args.json).expanduser()
        tmp = out.with_name(f".{out.name}.tmp")
        try:
            tmp.write_text(json.dumps(rep.to_dict(), indent=2) + "\n", encoding="utf-8")
            os.replace(tmp, out)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            print(f"nemo-fp8-check: could not write --json {args.json}: {e}", file=sys.stderr)
            return 2
    if rep.errors or (args.strict and rep.warnings):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
