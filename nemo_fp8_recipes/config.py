"""The Hydra layer every command line shares: the packaged config tree, composition, typed views of
its blocks, how runs are named, and clear errors.

The configs live inside the package (``nemo_fp8_recipes/configs``; the repository's top-level
``configs/`` is a symlink to it), so the installed ``nemo-fp8-train`` finds them wherever it is
installed. Groups mirror the registries: ``recipe/<key>.yaml`` for every key of
:func:`nemo_fp8_recipes.recipes.list_recipes`, ``model/<name>.yaml``, ``backend/``, ``cluster/``,
``data/``. The ``trainer`` and ``run`` blocks are validated against typed dataclasses here, so a
misspelt key or a wrong type fails before anything runs, with the valid keys listed.

The command lines (the trainer, the Bridge launcher, the validator, SLURM submission) import it;
the core (recipes, policy, quant, nn, models, data) knows nothing of Hydra.

Runs are named ``<recipe>[-<tag>][-<key><value>...]`` (:func:`run_name`): the keys of
``run.sweep`` are those a sweep varies, so every job of ``nemo-fp8-train -m ... trainer.seed=1,2,3``
has its own run (``bf16-seed1``, ``bf16-seed2``, ...); ``nemo-fp8-train -m`` and
``nemo-fp8-submit -m`` fill ``run.sweep`` (:func:`with_sweep_names`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

if TYPE_CHECKING:  # annotations only: importing this module needs no torch
    import torch

__all__ = [
    "CONFIG_DIR",
    "CONFIG_NAME",
    "GROUPS",
    "ConfigError",
    "TrainerConfig",
    "uses_cuda_graphs",
    "RunConfig",
    "run_name",
    "register_resolvers",
    "swept_keys",
    "with_sweep_names",
    "list_group_options",
    "compose_config",
    "override_value",
    "checked_config",
    "validate_overrides",
    "trainer_config",
    "run_config",
    "recipe_overrides",
    "build_recipe",
    "build_policy",
    "build_kernel_options",
    "resolve_device",
    "COMPILE_MODES",
    "CUDA_GRAPH_MODES",
]

#: Absolute path of the packaged Hydra config directory.
CONFIG_DIR = str(Path(__file__).resolve().parent / "configs")
CONFIG_NAME = "train"
#: Config groups (each a directory of ``<option>.yaml`` under :data:`CONFIG_DIR`).
GROUPS = ("recipe", "model", "backend", "kernels", "cluster", "data")
_HYDRA_VERSION_BASE = "1.3"


class ConfigError(ValueError):
    """A bad configuration value or key; the message lists what is valid."""


# ---- typed blocks ------------------------------------------------------------------------------
@dataclass
class TrainerConfig:
    """Typed ``trainer`` block (values come from ``train.yaml``; see the comments there)."""

    max_steps: int
    micro_batch_size: int
    global_batch_size: int
    seq_len: int
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    grad_clip: float
    seed: int
    compile: bool
    device: str
    autocast: str
    val_interval: int
    val_steps: int
    log_interval: int
    telemetry_interval: int
    ckpt_interval: int
    ckpt_keep: int
    checkpoint: bool
    resume: str
    force_resume: bool
    nan_policy: str
    max_skipped_steps: int
    progress: bool
    data_parallel: str = "ddp"
    fuse_wgrad_accumulation: bool = False
    compiled_weight_cache: bool = True
    memory_check: bool = True
    compile_mode: str = "default"
    deterministic: bool = False

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"trainer.{msg}")

        need(self.max_steps >= 1, f"max_steps must be >= 1, got {self.max_steps}")
        need(self.micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        need(
            self.global_batch_size >= self.micro_batch_size and self.global_batch_size % self.micro_batch_size == 0,
            f"global_batch_size ({self.global_batch_size}) must be a positive multiple of "
            f"micro_batch_size ({self.micro_batch_size}); the ratio is the gradient accumulation",
        )
        need(self.seq_len >= 1, f"seq_len must be >= 1, got {self.seq_len}")
        need(
            math.isfinite(self.lr) and self.lr > 0 and math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr,
            f"lr must be a finite number > 0 and min_lr in [0, lr]; got lr={self.lr}, min_lr={self.min_lr}",
        )
        need(
            0 <= self.seed < 2**32,
            f"seed must be an integer in [0, 2**32 - 1] (NumPy's and CUDA's generators take 32 bits), got {self.seed}",
        )
        for k in ("beta1", "beta2"):
            v = getattr(self, k)
            need(
                math.isfinite(v) and 0.0 <= v < 1.0,
                f"{k} must be in [0, 1) (AdamW's moving-average coefficient; typical 0.9 / 0.95), got {v}",
            )
        need(
            math.isfinite(self.eps) and self.eps >= _FP32_TINY,
            f"eps must be a finite number >= {_FP32_TINY:.3g}, the smallest normal FP32 number (AdamW's "
            f"denominator guard, added in FP32: a smaller one is 0 or denormal there; typical 1e-8), got {self.eps}",
        )
        need(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            f"weight_decay must be a finite number >= 0 (0 = off; typical 0.1), got {self.weight_decay}",
        )
        need(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        need(
            math.isfinite(self.grad_clip) and self.grad_clip >= 0,
            f"grad_clip must be a finite number >= 0 (0 = off), got {self.grad_clip}",
        )
        need(
            self.log_interval >= 1,
            f"log_interval must be >= 1 (steps between log lines and TensorBoard points; the last step is "
            f"always logged: log_interval={self.max_steps} logs it alone), got {self.log_interval}",
        )
        for k in (
            "val_interval",
            "val_steps",
            "telemetry_interval",
            "ckpt_interval",
            "max_skipped_steps",
        ):
            need(getattr(self, k) >= 0, f"{k} must be >= 0, got {getattr(self, k)}")
        need(self.ckpt_keep >= 1, f"ckpt_keep must be >= 1, got {self.ckpt_keep}")
        need(
            self.autocast in ("auto", "bf16", "off"),
            f"autocast={self.autocast!r} is not valid; choose one of: auto, bf16, off",
        )
        need(
            self.nan_policy in ("stop", "skip"),
            f"nan_policy={self.nan_policy!r} is not valid; choose one of: stop, skip",
        )
        need(
            bool(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device)),
            f"device={self.device!r} is not valid; choose one of: auto, cpu, cuda, cuda:N",
        )
        need(bool(self.resume), "resume must be auto, never or a checkpoint path")
        need(
            self.data_parallel in ("ddp", "fsdp2"),
            f"data_parallel={self.data_parallel!r} is not valid; choose one of: ddp, fsdp2",
        )
        need(
            self.compile_mode in COMPILE_MODES,
            f"compile_mode={self.compile_mode!r} is not valid; choose one of: {', '.join(COMPILE_MODES)}",
        )
        need(
            self.compile or self.compile_mode == "default",
            f"compile_mode={self.compile_mode} is a torch.compile mode; it needs trainer.compile=true",
        )
        need(
            not (self.fuse_wgrad_accumulation and self.compile),
            "fuse_wgrad_accumulation=true applies to the eager FP8 linears, and trainer.compile=true traces "
            "them (the traced linears return their gradients); turn one of the two off",
        )

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step."""
        return self.global_batch_size // self.micro_batch_size


@dataclass
class RunConfig:
    """Typed ``run`` block: where the run writes (``dir``) and whether TensorBoard is on."""

    root: str
    tag: Optional[str]
    dir: str
    tensorboard: bool
    sweep: List[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        tag = "" if self.tag is None else str(self.tag).strip()
        if tag and (not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", tag) or ".." in tag):
            raise ConfigError(
                f"run.tag={self.tag!r} is not a name: it becomes part of the run directory's name, so it takes "
                "letters, digits and . _ + - (starting with a letter or digit, no '..'), e.g. run.tag=lr3e-4"
            )


_FP32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny


# ---- run names and the resolvers ---------------------------------------------------------------
def _sweep_component(key: str, value: Any, leaf: str) -> str:
    """``seed1`` for ``trainer.seed=1``, ``first_layers_bf16_2`` for ``policy.first_layers_bf16=2``:
    the key's last part and the value, joined by ``_`` unless a letter meets a digit; characters
    other than letters, digits and ``.+-_`` become ``_``."""
    from omegaconf import DictConfig

    if isinstance(value, DictConfig):  # a config group: its option's name
        value = value.get("name", key)
    text = str(value).lower() if isinstance(value, bool) else str(value)
    sep = "" if leaf[-1:].isalpha() and text[:1].isdigit() else "_"
    return re.sub(r"[^A-Za-z0-9.+_-]", "_", f"{leaf}{sep}{text}")


def run_name(recipe: str, tag: Optional[str] = None, sweep: Sequence[str] = (), *, _root_=None) -> str:
    """Run directory leaf: ``<recipe>[-bridge][-<tag>]`` (``-bridge`` for ``backend=megatron_bridge``),
    then one ``-<key><value>`` per key of ``sweep`` (``run.sweep``; the values are read from the
    config, ``_root_``), e.g. ``bf16-seed1``."""
    from omegaconf import OmegaConf

    tag = "" if tag is None else str(tag).strip()
    # Megatron-Bridge's runs get a directory of their own: its checkpoints and events are not the
    # embedded trainer's, which a run of the same model and recipe would otherwise share
    if _root_ is not None and OmegaConf.select(_root_, "backend.name", default=None) == "megatron_bridge":
        recipe = f"{recipe}-bridge"
    parts = [f"{recipe}-{tag}" if tag else str(recipe)]
    keys = [str(k) for k in (sweep or ())]
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    for key, leaf in zip(keys, leaves):
        value = OmegaConf.select(_root_, key, default=None) if _root_ is not None else None
        parts.append(_sweep_component(key, value, leaf if leaves.count(leaf) == 1 else key))
    return "-".join(parts)


#: keys a sweep may vary that never name a run: the place it is written, the name itself, launchers
_NOT_NAMING = ("recipe", "model", "run.tag", "run.root", "run.dir", "run.sweep")


def swept_keys(overrides: Sequence[str]) -> List[str]:
    """The keys that ``overrides`` sweep (``trainer.seed=1,2,3``, ``range()``, ``choice()``) and
    that must name each job's run: all but ``recipe`` and ``model`` (already in the run's path),
    ``run.*`` and the ``hydra``, ``cluster`` and ``submit`` blocks. Unparsable overrides give []
    (Hydra reports them)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=[o for o in overrides if not o.startswith("-")])
    except Exception:  # noqa: BLE001 - Hydra says what is wrong when it parses them itself
        return []
    keys = []
    for o in parsed:
        key = o.key_or_group.split("@", 1)[0]
        head = key.split(".", 1)[0].split("/", 1)[0]
        if o.is_sweep_override() and key not in _NOT_NAMING and head not in ("hydra", "cluster", "submit"):
            keys.append(key)
    return keys


def with_sweep_names(overrides: Sequence[str]) -> List[str]:
    """``overrides`` plus ``run.sweep=[<swept keys>]`` when they sweep keys that must name the runs
    (:func:`swept_keys`) and do not set ``run.sweep`` themselves: every job of a sweep then has its
    own run directory (``bf16-seed1``, ``bf16-seed2``, ...) instead of resuming another's."""
    out = list(overrides)
    keys = swept_keys(out)
    if keys and not any(_override_key(o) == "run.sweep" for o in out):
        out.append(f"run.sweep=[{','.join(keys)}]")
    return out


def register_resolvers() -> None:
    """Register the ``fp8.*`` OmegaConf resolvers the configs use (idempotent)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("fp8.run_name"):
        OmegaConf.register_new_resolver("fp8.run_name", run_name)


register_resolvers()


# ---- composition -------------------------------------------------------------------------------
def list_group_options(group: str) -> List[str]:
    """Option names of a config group (file stems under ``configs/<group>/``)."""
    if group not in GROUPS:
        raise ConfigError(f"unknown config group {group!r}; groups: {', '.join(GROUPS)}")
    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))


def compose_config(overrides: Sequence[str] = ()):
    """Compose ``train.yaml`` with Hydra overrides (no run, no output dir) -> ``DictConfig``.

    The same composition as ``nemo-fp8-train <overrides>``; used by tests and notebooks.
    """
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=_HYDRA_VERSION_BASE):
        return compose(config_name=CONFIG_NAME, overrides=list(overrides))


_PLAIN_OVERRIDE_VALUE = re.compile(r"[A-Za-z0-9_./-]+")


def override_value(value: Any) -> str:
    """``value`` (a path, usually) written so that a Hydra override reads it back as this one string.

    Plain paths (with a ``/``, otherwise only letters, digits and ``_ . -``) stay as they
    are. Anything else is
    single-quoted with Hydra's escapes, so a comma is not read as a sweep (``run.root=/tmp/a,b``
    fails with "Ambiguous value"), and a space, ``=``, brackets, quotes or ``${`` stay literal::

        f"run.root={override_value(root)}"   # /tmp/e2e_bf16,tensorwise -> '/tmp/e2e_bf16,tensorwise'

    Raises :class:`ConfigError` for a backslash right before ``${``, which OmegaConf cannot keep
    literal here.
    """
    s = str(value)
    if _PLAIN_OVERRIDE_VALUE.fullmatch(s) and "/" in s:  # a path Hydra would not read as a number or bool
        return s
    if "\\${" in s:
        raise ConfigError(f"{s!r}: a backslash before '${{' cannot be passed as a Hydra override value; rename it")
    s = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, s)  # Hydra: backslashes before the closing quote double
    s = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", s)  # ... and before an escaped quote
    return "'" + s.replace("${", "\\${") + "'"  # OmegaConf: ${ escaped, not an interpolation


def _override_key(arg: str) -> str:
    key = arg.split("=", 1)[0]
    return key.lstrip("+~")


def _keys_at(cfg, path: str) -> Optional[List[str]]:
    from omegaconf import DictConfig, OmegaConf

    node = cfg if not path else OmegaConf.select(cfg, path, default=None)
    if isinstance(node, DictConfig):
        return [str(k) for k in node.keys()]
    return None


def _explain_unknown_key(full_key: str, overrides: Sequence[str]) -> str:
    """Message for a key that is not in the config: the valid keys of its parent node."""
    # Re-compose with the group choices only, so the listing is for the chosen recipe/model.
    group_choices = [o for o in overrides if "=" in o and _override_key(o) in GROUPS and not o.startswith(("+", "~"))]
    try:
        cfg = compose_config(group_choices)
    except Exception:  # noqa: BLE001 - fall back to the defaults
        cfg = compose_config()
    own = _keys_at(cfg, full_key)
    if own is not None:  # the key exists: a dict value sets keys this node does not have
        given = _dict_override_keys(full_key, overrides)
        unknown = [k for k in given if k not in own]
        hint = "; ".join(
            f"'{k}' -> did you mean '{h[0]}'?" for k in unknown for h in [difflib.get_close_matches(k, own, n=1)] if h
        )
        return (
            f"'{full_key}={{...}}' sets key(s) {', '.join(unknown) or '(unknown)'} that '{full_key}' does not "
            f"have{' (' + hint + ')' if hint else ''}.\nValid keys under '{full_key}': {', '.join(own)} "
            f"(set them one by one, e.g. {full_key}.{own[0]}=..., or in the dict)"
        )
    parent, _, leaf = full_key.rpartition(".")
    keys = _keys_at(cfg, parent)
    while keys is None and parent:  # e.g. trainer.foo.bar: walk up to an existing node
        parent, _, leaf = parent.rpartition(".")
        keys = _keys_at(cfg, parent)
    keys = keys or []
    where = f"'{parent}'" if parent else "the top level"
    valid = list(keys)
    if not parent:
        valid = sorted(set(valid) | set(GROUPS))
    hint = difflib.get_close_matches(leaf, valid, n=1)
    msg = f"unknown config key '{full_key}'."
    if hint:
        msg += f" Did you mean '{(parent + '.') if parent else ''}{hint[0]}'?"
    msg += f"\nValid keys under {where}: {', '.join(valid)}"
    if not parent:
        msg += "\nConfig groups and their options:\n" + "\n".join(
            f"  {g}: {', '.join(list_group_options(g))}" for g in GROUPS
        )
    msg += f"\n(To add a new key on purpose, prefix it with '+': +{full_key}=...)"
    return msg


def _dict_override_keys(key: str, overrides: Sequence[str]) -> List[str]:
    """Keys of a dict value given to ``key`` on the command line (``policy={a:1}`` -> ``['a']``)."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        for o in OverridesParser.create().parse_overrides(overrides=list(overrides)):
            if o.key_or_group == key and isinstance(o.value(), dict):
                return [str(k) for k in o.value()]
    except Exception:  # noqa: BLE001 - a message helper: fall back to no keys
        pass
    return []


def validate_overrides(overrides: Sequence[str]) -> Optional[str]:
    """None if ``overrides`` compose into a valid config, else the message of
    :func:`checked_config`."""
    return checked_config(overrides)[1]


def checked_config(overrides: Sequence[str]):
    """Compose with ``overrides`` and check the result: ``(config, None)`` if fine, else ``(None,
    message)`` with a clean, actionable message. Command lines check and then use the one config.

    Bad group options list the group's options (Hydra's message); unknown keys list the valid
    keys of their parent node with a close-match hint; the typed ``trainer``/``run`` blocks and the
    recipe, policy, model and data blocks are checked too. Nothing here depends on the machine
    (whether Transformer Engine imports, a GPU): the trainer checks that where it runs.
    """
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = compose_config(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        text = str(e)
        m = re.search(r"Could not override '([^']+)'", text) or re.search(
            r"Could not (?:append|delete) to config\. An item is already at '([^']+)'", text
        )
        cause = e.__cause__
        if m and (
            cause is None
            or "not in struct" in str(cause)
            or "No match in the defaults" in text
            or "Key '" in str(cause)
        ):
            return None, _explain_unknown_key(m.group(1), overrides)
        return None, text.split("Config search path:")[0].strip()
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        example = "[/path/to/corpus]" if missing[0].endswith("paths") else "..."
        return None, (
            f"missing mandatory value(s): {', '.join(missing)}; set them on the command line, "
            f"e.g. {missing[0]}={example}"
        )
    try:
        trainer_config(cfg)
        run_config(cfg)
        _check_blocks(cfg)
    except ConfigError as e:
        return None, str(e)
    return cfg, None


def _check_blocks(cfg) -> None:
    """The recipe, policy, model and data blocks as their owners validate them, so a bad value
    fails here, before Hydra starts a run (and writes a run directory)."""
    from omegaconf import OmegaConf

    build_recipe(cfg.recipe)
    build_policy(cfg.get("policy"))
    if cfg.backend.get("name") not in ("native", "te"):
        return  # Bridge's recipe function may define the model; its own validator checks it
    from .data import DataConfig, DataError
    from .models import ModelConfig

    try:
        ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
        DataConfig.from_dict(OmegaConf.to_container(cfg.data, resolve=True))
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e) if isinstance(e, DataError) else f"{e}") from None


def typed_config(node, cls, path: str):
    """Config block ``node`` (at ``path``) as the dataclass ``cls``: unknown keys are refused
    with the closest valid names, values are type-checked."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if node is None:
        raise ConfigError(f"the config has no '{path}' block")
    valid = [f.name for f in dataclasses.fields(cls)]
    present = [str(k) for k in node.keys()]
    unknown = [k for k in present if k not in valid]
    if unknown:
        hints = [
            f"'{path}.{k}' -> did you mean '{path}.{h[0]}'?"
            for k in unknown
            for h in [difflib.get_close_matches(k, valid, n=1)]
            if h
        ]
        raise ConfigError(
            f"unknown key(s) {', '.join(f'{path}.{k}' for k in unknown)}"
            + (f" ({'; '.join(hints)})" if hints else "")
            + f".\nValid keys under '{path}': {', '.join(valid)}"
        )
    missing = [k for k in valid if k not in present]
    if missing:
        raise ConfigError(f"'{path}' is missing key(s): {', '.join(missing)}")
    try:
        values = OmegaConf.to_container(node, resolve=True)
        merged = OmegaConf.merge(OmegaConf.structured(cls), values)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        first = str(e).splitlines()[0]
        key = getattr(e, "full_key", None) or ""
        raise ConfigError(f"bad value for '{path}.{key}': {first}" if key else f"'{path}': {first}") from None


def trainer_config(cfg) -> TrainerConfig:
    """The validated, typed ``trainer`` block of a composed config."""
    return typed_config(cfg.get("trainer"), TrainerConfig, "trainer")


def run_config(cfg) -> RunConfig:
    """The validated, typed ``run`` block of a composed config (``dir`` resolved)."""
    return typed_config(cfg.get("run"), RunConfig, "run")


def resolve_device(spec: str) -> "torch.device":
    """``auto`` -> ``cuda`` if available else ``cpu``; ``cuda`` without a GPU is an error."""
    import torch

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.device={spec} but no CUDA GPU is available; use trainer.device=cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"trainer.device={spec} but only {torch.cuda.device_count()} GPU(s) are visible")
    return dev


def build_recipe(recipe_node):
    """The registry recipe for a ``recipe`` config node (``null`` fields = registry defaults)."""
    from .recipes import get_recipe

    name = recipe_node.get("name")
    if not name:
        raise ConfigError("the recipe config has no 'name'")
    try:
        return get_recipe(name, **recipe_overrides(recipe_node))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"recipe: {e}") from None


def build_kernel_options(kernels_node):
    """The :class:`~nemo_fp8_recipes.options.KernelOptions` of the ``kernels`` config group
    (``null`` fields = the default: on, or what ``NEMO_FP8_<OPTION>`` says)."""
    from omegaconf import DictConfig, OmegaConf

    from .options import KernelOptions

    values = (
        OmegaConf.to_container(kernels_node, resolve=True)
        if isinstance(kernels_node, DictConfig)
        else dict(kernels_node or {})
    )
    values = {k: v for k, v in values.items() if v is not None}
    try:
        return KernelOptions.from_mapping(values)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"kernels: {e}") from None


def build_policy(policy_node):
    """A :class:`~nemo_fp8_recipes.policy.PrecisionPolicy` from the ``policy`` config node."""
    from omegaconf import DictConfig, OmegaConf

    from .policy import PrecisionPolicy

    if policy_node is not None and not isinstance(policy_node, (DictConfig, dict)):
        valid = ", ".join(f.name for f in dataclasses.fields(PrecisionPolicy))
        raise ConfigError(
            f"policy must be a block of options, got {policy_node!r}; set them one by one, e.g. "
            f"policy.first_layers_bf16=1 (options: {valid})"
        )
    values = (
        OmegaConf.to_container(policy_node, resolve=True)
        if isinstance(policy_node, DictConfig)
        else dict(policy_node or {})
    )
    valid = [f.name for f in dataclasses.fields(PrecisionPolicy)]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ConfigError(f"unknown policy option(s) {unknown}; valid options: {', '.join(valid)}")
    for k in ("include", "exclude"):
        if k in values and isinstance(values[k], (list, tuple)):
            values[k] = tuple(values[k])
    try:
        return PrecisionPolicy(**values)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"policy: {e}") from None


def _prune_none(d: Dict[str, Any]) -> Dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            v = _prune_none(v)
            if not v:
                continue
        if v is None and k != "emulate":
            continue
        out[k] = v
    return out


def recipe_overrides(recipe_node) -> Dict[str, Any]:
    """``get_recipe`` keyword overrides from a ``recipe`` config node: ``name`` dropped, ``null``
    values (= registry default) dropped, also inside nested GEMM blocks; ``emulate`` kept."""
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(recipe_node, resolve=True)
    values.pop("name", None)
    return _prune_none(values)


# ---- torch.compile modes ---------------------------------------------------------------------------
#: torch.compile's modes (``trainer.compile_mode``); the ones that replay the compiled graphs as CUDA graphs
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def uses_cuda_graphs(tcfg: TrainerConfig) -> bool:
    """Whether the compiled model replays its graphs as CUDA graphs (``trainer.compile_mode``)."""
    return tcfg.compile and tcfg.compile_mode in CUDA_GRAPH_MODES
