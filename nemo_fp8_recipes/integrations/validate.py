"""Pre-launch validation: ``nemo-fp8-check`` (CLI) and :func:`validate` (API).

Catches, before a job is queued, the FP8 set-ups that Megatron-Core, Megatron-Bridge or
Transformer Engine would reject late, or — worse — accept and silently change (docs/megatron.md,
"Check before you launch"):

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
...                     see :mod:`.validate_checks` (one check per code)
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

from ..hardware import GPUS, DeviceInfo, describe_device, device_from_name, normalise_gpu_name
from ..policy import PrecisionPolicy
from ..recipes import Recipe, get_recipe
from ..versions import version_tuple
from .megatron import megatron_config
from .te import TEUnsupportedError, te_available, te_recipe_spec
from .te import te_version as _installed_te_version
from .validate_checks import (
    TE_BACKENDS,
    Finding,
    bridge_mixed_precision_fields,
    check_all_layers_bf16,
    check_attention_fp8,
    check_bf16_layers_per_stage,
    check_bridge_clobber,
    check_delayed_first_last,
    check_delayed_history_1,
    check_fp8_param_gather,
    check_fp8_wgrad_noop,
    check_hardware,
    check_layer_dims,
    check_local_spec_fp8,
    check_mixed_precision_replaced,
    check_moe_fp8_no_te,
    check_no_te,
    check_nvte_env,
    check_policy_include_te,
    check_pp_layer_patterns,
    check_recipe_conflict,
    check_recipe_numerics,
    check_router_dtype,
    check_te_imported_settings,
    check_te_unexpressible,
    check_te_version,
    check_token_dims,
)

__all__ = [
    "BACKENDS",
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


class ValidationError(ValueError):
    """Raised by :meth:`ValidationReport.raise_for_errors`; the message lists every error."""


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
        lines.append(
            f"{len(self.errors)} error(s), {len(self.warnings)} warning(s)" + ("" if self.errors else ": OK to launch")
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe,
            "backend": self.backend,
            "target": self.target,
            "ok": self.ok,
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
    named = device_from_name(spec, cv)
    if named is not None:
        return named
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
    from ..config import compose_config

    return str(compose_config([]).model.name)


def _bridge_builds_our_model(args: Sequence[str]) -> bool:
    """Whether a Megatron-Bridge launch builds the model from our config (``backend.provider``),
    so that ``model.<our field>`` overrides are ours; else they are the Bridge provider's."""
    from .bridge.recipes import BridgeLaunchError, provider_mode

    def value(key: str, default=None):
        return next((a.split("=", 1)[1] for a in args if a.split("=", 1)[0].lstrip("+") == key), default)

    try:
        return (
            provider_mode(
                value("model") or _default_model(),
                value("backend.provider", "auto"),
                value("backend.recipe_fn") if value("backend.recipe_fn") not in (None, "null") else None,
            )
            == "ours"
        )
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


#: ``model.<Megatron field>=`` overrides that set a model dim (field, dim).
_DIM_OVERRIDES = (
    ("hidden_size", "hidden"),
    ("ffn_hidden_size", "ffn"),
    ("num_attention_heads", "heads"),
    ("num_query_groups", "kv_heads"),
    ("kv_channels", "head_dim"),
    ("num_layers", "layers"),
    ("num_moe_experts", "experts"),
    ("moe_ffn_hidden_size", "moe_ffn"),
)


def _dims_from_overrides(ov: Mapping[str, Any]) -> Dict[str, Any]:
    """The model dims that ``model.<field>=`` overrides set (they win over ``model``)."""
    return {dst: ov[f"model.{src}"] for src, dst in _DIM_OVERRIDES if ov.get(f"model.{src}") is not None}


def _te_on_target(te_version: Union[None, str, Sequence[int]]) -> Tuple[Optional[str], Optional[Tuple[int, ...]]]:
    """``(te_missing, target_te)``: why Transformer Engine is not importable when the target is this
    machine (``te_version="auto"``) and TE is not installed here, else None; and the TE version on
    the target (None = unknown)."""
    installed, why = te_available()
    te_missing = why if not installed and te_version == "auto" else None
    return te_missing, (_installed_te_version() if te_version == "auto" else version_tuple(te_version))


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

    The checks live in :mod:`.validate_checks`, one per finding code; the report lists their
    findings in the order they run here.
    """
    r = recipe if isinstance(recipe, Recipe) else get_recipe(recipe)
    p = policy or PrecisionPolicy()
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not valid; choose one of: {', '.join(BACKENDS)}")
    env = dict(os.environ if environ is None else environ)
    ov = dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(overrides or ())
    target = parse_gpu(device)
    rep = ValidationReport(recipe=r.name, backend=backend, target=str(target))
    dims = _model_dims(model)
    dims.update(_dims_from_overrides(ov))
    pp = pipeline_model_parallel_size or ov.get("model.pipeline_model_parallel_size") or 1
    mbs = micro_batch_size or ov.get("train.micro_batch_size")
    seq = seq_len or ov.get("model.seq_length") or ov.get("dataset.seq_length")
    num_layers = dims.get("layers")
    fp8_on_te = backend in TE_BACKENDS and r.is_fp8
    # Read on both TE backends: importing Megatron-Bridge can import TE, and the te-import-order
    # check looks at the TE this process has loaded.
    mp_fields = set(bridge_mixed_precision_fields()) if fp8_on_te else set()
    te_missing, target_te = _te_on_target(te_version) if fp8_on_te else (None, None)

    findings = rep.findings
    # recipe and hardware
    findings += check_te_unexpressible(r, backend)
    findings += check_hardware(r, backend, target)
    findings += check_recipe_numerics(r)
    # first/last BF16 layers, pipeline stages, policy patterns
    findings += check_delayed_first_last(r, p, backend, ov)
    findings += check_bf16_layers_per_stage(p, backend, num_layers, pp)
    findings += check_all_layers_bf16(r, p, num_layers)
    findings += check_pp_layer_patterns(p, backend, pp)
    findings += check_policy_include_te(p, backend)
    # framework overrides against the effective Megatron / Bridge settings
    findings += check_bridge_clobber(r, backend, ov, mp_fields)
    findings += check_mixed_precision_replaced(r, backend, ov)
    findings += check_recipe_conflict(r, p, backend, ov)
    findings += check_fp8_wgrad_noop(r, backend, ov)
    findings += check_attention_fp8(r, backend, ov)
    findings += check_delayed_history_1(r, backend, ov)
    findings += check_router_dtype(r, backend, ov, dims)
    findings += check_local_spec_fp8(r, backend, ov)
    findings += check_fp8_param_gather(r, backend, ov, fp8_param_gather)
    # Transformer Engine: presence, version, environment
    findings += check_no_te(r, backend, te_missing)
    findings += check_moe_fp8_no_te(r, backend, te_missing, dims)
    findings += check_te_version(r, backend, target_te)
    findings += check_nvte_env(r, backend, env)
    findings += check_te_imported_settings(r, backend)
    # GEMM shapes
    findings += check_layer_dims(r, p, backend, dims)
    findings += check_token_dims(r, backend, mbs, seq)

    rep.settings = _settings_rows(r, p, backend, target, ov, fp8_param_gather)
    return rep


def _settings_rows(
    r: Recipe, p: PrecisionPolicy, backend: str, target: DeviceInfo, ov: Mapping[str, Any], fp8_param_gather: bool
) -> List[Tuple[str, str, str]]:
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
            mc = megatron_config(r, safe_policy, fp8_param=fp8_param_gather and backend == "megatron_bridge")
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
                rows.append(
                    ("te_precision_config", f"{len(mc.te_precision_config['matchers'])} BF16 matcher(s)", "policy")
                )
            for var, val in mc.env.items():
                rows.append((var, val, "recipe scale_rounding"))
            try:
                rows.append(("TE recipe", te_recipe_spec(r).describe().split(" [env")[0], "to_te_recipe"))
            except TEUnsupportedError:
                pass
        if backend == "megatron_bridge":
            fpg = ov.get("mixed_precision.fp8_param_gather", fp8_param_gather)
            rows.append(
                ("fp8_param_gather", str(fpg), "override" if "mixed_precision.fp8_param_gather" in ov else "backend")
            )
            rows.append(("bf16 / params_dtype", "True / torch.bfloat16", "mixed_precision"))
    rows.append(("policy.attention_projections", p.attention_projections, "policy"))
    rows.append(("policy.first/last_layers_bf16", f"{p.first_layers_bf16}/{p.last_layers_bf16}", "policy"))
    if p.exclude:
        rows.append(("policy.exclude", ",".join(p.exclude), "policy"))
    rows.append(("kept out of FP8 by role", "embedding, output, router (fp32), norms, attention core", "policy"))
    return rows


def validate_config(
    cfg,
    framework_overrides: Sequence[str] = (),
    *,
    device=None,
    te_version="auto",
    environ=None,
    backend: Optional[str] = None,
) -> ValidationReport:
    """:func:`validate` for a composed ``nemo-fp8-train`` config (``DictConfig``) plus framework
    overrides (the arguments :func:`split_overrides` did not claim)."""
    from omegaconf import OmegaConf

    from ..config import build_policy, build_recipe

    r = build_recipe(cfg.recipe)
    p = build_policy(cfg.get("policy"))
    backend = backend or str(cfg.backend.name)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if backend == "megatron_bridge" and cfg.backend.get("recipe_fn"):
        model = None  # the Bridge recipe function defines the model; our model= dims do not apply
    tr = cfg.get("trainer")
    mbs = tr.micro_batch_size if tr is not None and backend == "native" else None
    seq = tr.seq_len if tr is not None and backend == "native" else None
    fpg = False
    if backend == "megatron_bridge":
        from .bridge.recipes import resolved_fp8_param_gather

        fpg = resolved_fp8_param_gather(cfg.backend, r.name)
    if backend == "native" and framework_overrides:
        raise ValueError(
            f"backend=native takes no framework overrides, got {list(framework_overrides)}; these keys belong "
            "to backend=te or backend=megatron_bridge"
        )
    return validate(
        r,
        p,
        backend=backend,
        model=model,
        device=device,
        te_version=te_version,
        overrides=list(framework_overrides),
        micro_batch_size=mbs,
        seq_len=seq,
        fp8_param_gather=fpg,
        environ=environ,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``nemo-fp8-check [--gpu h100] [--cuda 12.9] [--te 2.9] [--json out.json] [--strict]
    <hydra overrides> <framework overrides>``."""
    from ..config import checked_config

    parser = argparse.ArgumentParser(
        prog="nemo-fp8-check",
        description="Check an FP8 configuration before launch. Arguments without '--' are Hydra overrides "
        "(as for nemo-fp8-train: recipe=, policy.*, model=, backend=) and framework overrides "
        "(model.<TransformerConfig field>=, mixed_precision.*=, ddp.*=, train.*=).",
    )
    parser.add_argument(
        "--gpu",
        default=None,
        help="target GPU: h100, h200, b200, gb200, b300, rtx5090, smNN, cpu (default: this machine)",
    )
    parser.add_argument("--cuda", default=None, help="CUDA version on the target, e.g. 12.9")
    parser.add_argument(
        "--te", default="auto", help="Transformer Engine version on the target (default: installed here)"
    )
    parser.add_argument("--json", default=None, help="also write the report as JSON to this path")
    parser.add_argument("--strict", action="store_true", help="treat warnings as errors")
    parser.add_argument(
        "--megatron",
        action="store_true",
        help="check for plain Megatron-Core / Megatron-LM with Transformer Engine (backend te); "
        "model.<field>= overrides are then TransformerConfig fields",
    )
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    flags = [a for a in rest if a.startswith("-")]
    if flags:
        print(f"nemo-fp8-check: unknown option(s) {flags}; see --help", file=sys.stderr)
        return 2
    if args.te != "auto" and not re.fullmatch(r"\d+(\.\d+){0,3}([.+-]?[A-Za-z0-9.+-]*)?", str(args.te)):
        print(
            f"nemo-fp8-check: --te {args.te!r} is not a Transformer Engine version like 2.9 or 2.20.2 "
            "(or auto: the one installed here)",
            file=sys.stderr,
        )
        return 2
    if args.json:
        parent = Path(args.json).expanduser().resolve().parent
        if not parent.is_dir():
            print(
                f"nemo-fp8-check: --json {args.json}: the directory {parent} does not exist; create it "
                f"(mkdir -p {parent}) or write the report elsewhere",
                file=sys.stderr,
            )
            return 2
        if Path(args.json).is_dir():
            print(
                f"nemo-fp8-check: --json {args.json} is a directory; give a file name (e.g. "
                f"{Path(args.json) / 'check.json'})",
                file=sys.stderr,
            )
            return 2
    backend = "te" if args.megatron else None
    ours, theirs = split_overrides(rest, backend=backend)
    cfg, problem = checked_config(ours)
    if problem:
        print(f"nemo-fp8-check: {problem}", file=sys.stderr)
        return 2
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
