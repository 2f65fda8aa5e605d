"""Hydra side of the embedded trainer: the packaged config tree, composition, and clear errors.

The configs live inside the package (``nemo_fp8_recipes/configs``; the repository's top-level
``configs/`` is a symlink to it), so the installed ``nemo-fp8-train`` finds them wherever it is
installed. Groups mirror the registries: ``recipe/<key>.yaml`` for every key of
:func:`nemo_fp8_recipes.recipes.list_recipes`, ``model/<name>.yaml``, ``backend/``, ``cluster/``,
``data/``. The ``trainer`` and ``run`` blocks are validated against typed dataclasses here, so a
misspelt key or a wrong type fails before anything runs, with the valid keys listed.

Only the trainer imports this module; the core (recipes, policy, quant, nn) knows nothing of
Hydra.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from .run_names import register_resolvers

if TYPE_CHECKING:  # annotations only: importing this module needs no torch
    import torch

    from .data import DataConfig
    from .models import ModelConfig

__all__ = [
    "CONFIG_DIR",
    "CONFIG_NAME",
    "GROUPS",
    "ConfigError",
    "TrainerConfig",
    "uses_cuda_graphs",
    "RunConfig",
    "list_group_options",
    "compose_config",
    "validate_overrides",
    "trainer_config",
    "run_config",
    "recipe_overrides",
    "build_recipe",
    "build_policy",
    "build_kernel_options",
    "resolve_device",
    "NO_CPU_COMPILE",
    "check_embedded_run",
    "check_batch_split",
    "model_and_data_configs",
    "COMPILE_MODES",
    "CUDA_GRAPH_MODES",
    "check_compile_mode",
    "check_cpu_compile",
    "check_memory",
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
        need(self.global_batch_size >= self.micro_batch_size
             and self.global_batch_size % self.micro_batch_size == 0,
             f"global_batch_size ({self.global_batch_size}) must be a positive multiple of "
             f"micro_batch_size ({self.micro_batch_size}); the ratio is the gradient accumulation")
        need(self.seq_len >= 1, f"seq_len must be >= 1, got {self.seq_len}")
        need(math.isfinite(self.lr) and self.lr > 0 and math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr,
             f"lr must be a finite number > 0 and min_lr in [0, lr]; got lr={self.lr}, min_lr={self.min_lr}")
        need(0 <= self.seed < 2**32,
             f"seed must be an integer in [0, 2**32 - 1] (NumPy's and CUDA's generators take 32 bits), "
             f"got {self.seed}")
        for k in ("beta1", "beta2"):
            v = getattr(self, k)
            need(math.isfinite(v) and 0.0 <= v < 1.0,
                 f"{k} must be in [0, 1) (AdamW's moving-average coefficient; typical 0.9 / 0.95), got {v}")
        need(math.isfinite(self.eps) and self.eps > 0,
             f"eps must be a finite number > 0 (AdamW's denominator guard; typical 1e-8), got {self.eps}")
        need(math.isfinite(self.weight_decay) and self.weight_decay >= 0,
             f"weight_decay must be a finite number >= 0 (0 = off; typical 0.1), got {self.weight_decay}")
        need(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        need(math.isfinite(self.grad_clip) and self.grad_clip >= 0,
             f"grad_clip must be a finite number >= 0 (0 = off), got {self.grad_clip}")
        for k in ("val_interval", "val_steps", "log_interval", "telemetry_interval",
                  "ckpt_interval", "max_skipped_steps"):
            need(getattr(self, k) >= 0, f"{k} must be >= 0, got {getattr(self, k)}")
        need(self.ckpt_keep >= 1, f"ckpt_keep must be >= 1, got {self.ckpt_keep}")
        need(self.autocast in ("auto", "bf16", "off"),
             f"autocast={self.autocast!r} is not valid; choose one of: auto, bf16, off")
        need(self.nan_policy in ("stop", "skip"),
             f"nan_policy={self.nan_policy!r} is not valid; choose one of: stop, skip")
        need(bool(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device)),
             f"device={self.device!r} is not valid; choose one of: auto, cpu, cuda, cuda:N")
        need(bool(self.resume), "resume must be auto, never or a checkpoint path")
        need(self.data_parallel in ("ddp", "fsdp2"),
             f"data_parallel={self.data_parallel!r} is not valid; choose one of: ddp, fsdp2")
        need(self.compile_mode in COMPILE_MODES,
             f"compile_mode={self.compile_mode!r} is not valid; choose one of: {', '.join(COMPILE_MODES)}")
        need(self.compile or self.compile_mode == "default",
             f"compile_mode={self.compile_mode} is a torch.compile mode; it needs trainer.compile=true")
        need(not (self.fuse_wgrad_accumulation and self.compile),
             "fuse_wgrad_accumulation=true applies to the eager FP8 linears, and trainer.compile=true traces "
             "them (the traced linears return their gradients); turn one of the two off")

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


# ---- resolvers ---------------------------------------------------------------------------------
register_resolvers()  # the fp8.* resolvers the configs use (run naming)


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
    group_choices = [o for o in overrides if "=" in o and _override_key(o) in GROUPS
                     and not o.startswith(("+", "~"))]
    try:
        cfg = compose_config(group_choices)
    except Exception:  # noqa: BLE001 - fall back to the defaults
        cfg = compose_config()
    own = _keys_at(cfg, full_key)
    if own is not None:  # the key exists: a dict value sets keys this node does not have
        given = _dict_override_keys(full_key, overrides)
        unknown = [k for k in given if k not in own]
        hint = "; ".join(f"'{k}' -> did you mean '{h[0]}'?" for k in unknown
                         for h in [difflib.get_close_matches(k, own, n=1)] if h)
        return (f"'{full_key}={{...}}' sets key(s) {', '.join(unknown) or '(unknown)'} that '{full_key}' does not "
                f"have{' (' + hint + ')' if hint else ''}.\nValid keys under '{full_key}': {', '.join(own)} "
                f"(set them one by one, e.g. {full_key}.{own[0]}=..., or in the dict)")
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


def validate_overrides(overrides: Sequence[str], *, this_machine: bool = True) -> Optional[str]:
    """Compose with ``overrides``; return None if fine, else a clean, actionable message.

    Bad group options list the group's options (Hydra's message); unknown keys list the valid
    keys of their parent node with a close-match hint; the typed ``trainer``/``run`` blocks are
    checked too. ``this_machine=False`` (a job rendered for other nodes) leaves out what depends on
    the machine it runs on (Transformer Engine installed, a GPU).
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
        if m and (cause is None or "not in struct" in str(cause) or "No match in the defaults" in text
                  or "Key '" in str(cause)):
            return _explain_unknown_key(m.group(1), overrides)
        return text.split("Config search path:")[0].strip()
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        return (
            f"missing mandatory value(s): {', '.join(missing)}; set them on the command line, "
            f"e.g. {missing[0]}=" + ("[/path/to/corpus]" if missing[0].endswith("paths") else "...")
        )
    try:
        trainer_config(cfg)
        run_config(cfg)
        _check_blocks(cfg, this_machine)
    except ConfigError as e:
        return str(e)
    return None


def _check_blocks(cfg, this_machine: bool = True) -> None:
    """The recipe, policy, model and data blocks as their owners validate them, so a bad value
    fails here, before Hydra starts a run (and writes a run directory)."""
    from omegaconf import OmegaConf

    build_recipe(cfg.recipe)
    build_policy(cfg.get("policy"))
    if cfg.backend.get("name") not in ("native", "te"):
        return  # Bridge's recipe function may define the model; its own validator checks it
    if cfg.backend.get("name") == "te" and this_machine:
        from .integrations.te_model import te_backend_problem

        problem = te_backend_problem(resolve_device(str(cfg.trainer.device)))
        if problem:
            raise ConfigError(problem)
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
        hints = [f"'{path}.{k}' -> did you mean '{path}.{h[0]}'?"
                 for k in unknown for h in [difflib.get_close_matches(k, valid, n=1)] if h]
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

    values = (OmegaConf.to_container(kernels_node, resolve=True) if isinstance(kernels_node, DictConfig)
              else dict(kernels_node or {}))
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
        raise ConfigError(f"policy must be a block of options, got {policy_node!r}; set them one by one, e.g. "
                          f"policy.first_layers_bf16=1 (options: {valid})")
    values = (OmegaConf.to_container(policy_node, resolve=True) if isinstance(policy_node, DictConfig)
              else dict(policy_node or {}))
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


# ---- what the embedded trainer checks before any work ---------------------------------------
#: recipes whose emulation torch.compile's CPU (C++) backend cannot compile
NO_CPU_COMPILE = ("blockwise", "mxfp8")


def check_embedded_run(cfg) -> Tuple[TrainerConfig, RunConfig, str]:
    """The typed ``trainer`` and ``run`` blocks and the backend name of a composed config, after
    checking that the embedded trainer runs it (no missing value, backend native or te, cluster
    local); the errors name the launcher that runs the other cases."""
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"missing mandatory value(s): {', '.join(missing)}")
    tcfg = trainer_config(cfg)
    rcfg = run_config(cfg)
    backend = str(cfg.backend.name)
    if backend not in ("native", "te"):
        raise ConfigError(
            f"the embedded trainer runs backend=native or backend=te, got backend={backend}; launch "
            "Megatron-Bridge with `torchrun ... -m nemo_fp8_recipes.integrations.bridge <overrides>` "
            "or submit it with `nemo-fp8-submit backend=megatron_bridge ...`"
        )
    if cfg.cluster.name != "local":
        raise ConfigError(
            f"the embedded trainer runs cluster=local, got cluster={cfg.cluster.name}; submit "
            f"cluster={cfg.cluster.name} jobs with `nemo-fp8-submit <same overrides>`"
        )
    return tcfg, rcfg, backend


def check_batch_split(tcfg: TrainerConfig, world: int) -> None:
    """The global batch must split into whole micro-batches on each of ``world`` data-parallel ranks."""
    if tcfg.global_batch_size % (tcfg.micro_batch_size * world):
        raise ConfigError(
            f"trainer.global_batch_size ({tcfg.global_batch_size}) must be a multiple of "
            f"trainer.micro_batch_size ({tcfg.micro_batch_size}) x {world} data-parallel ranks; "
            f"e.g. trainer.global_batch_size={tcfg.micro_batch_size * world * max(1, tcfg.grad_accum // world)}"
        )


def model_and_data_configs(cfg, tcfg: TrainerConfig, vocab_size: int) -> Tuple["ModelConfig", "DataConfig"]:
    """The ``model`` and ``data`` blocks as their typed configs, checked against the trainer: the
    model's vocabulary holds the tokenizer's ``vocab_size`` ids and its context ``trainer.seq_len``."""
    from omegaconf import OmegaConf

    from .data import DataConfig, DataError
    from .models import ModelConfig

    try:
        mcfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
        dcfg = DataConfig.from_dict(OmegaConf.to_container(cfg.data, resolve=True))
    except DataError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None
    if mcfg.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size={mcfg.vocab_size} is smaller than the byte tokenizer's "
            f"{vocab_size} ids; use model.vocab_size=512 (or any value >= {vocab_size})"
        )
    if tcfg.seq_len > mcfg.max_seq_len:
        raise ConfigError(f"trainer.seq_len={tcfg.seq_len} exceeds model.max_seq_len={mcfg.max_seq_len}")
    return mcfg, dcfg


#: torch.compile's modes (``trainer.compile_mode``); the ones that replay the compiled graphs as CUDA graphs
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def uses_cuda_graphs(tcfg: TrainerConfig) -> bool:
    """Whether the compiled model replays its graphs as CUDA graphs (``trainer.compile_mode``)."""
    return tcfg.compile and tcfg.compile_mode in CUDA_GRAPH_MODES


def check_compile_mode(tcfg: TrainerConfig, device: "torch.device", *, world_size: int) -> None:
    """Refuse a CUDA-graph ``trainer.compile_mode`` where it cannot run as asked: it needs a CUDA
    device (Inductor would silently skip the graphs on CPU) and one process (the gradient hooks of
    DDP and FSDP2 run between the graph replays). (backend=te refuses ``trainer.compile`` itself.)"""
    if not uses_cuda_graphs(tcfg):
        return
    mode = tcfg.compile_mode
    if device.type != "cuda":
        raise ConfigError(f"trainer.compile_mode={mode} replays the compiled graphs as CUDA graphs and needs a CUDA "
                          f"device (this run: {device.type}); use trainer.compile_mode=default on CPU")
    if world_size > 1:
        raise ConfigError(f"trainer.compile_mode={mode} runs in one process only: under torchrun the "
                          f"{tcfg.data_parallel} gradient hooks run between the CUDA-graph replays ({world_size} "
                          "ranks); use trainer.compile_mode=default there")


def check_cpu_compile(tcfg: TrainerConfig, recipe, device: "torch.device") -> None:
    """Refuse ``trainer.compile=true`` on CPU for the recipes in :data:`NO_CPU_COMPILE`.

    Inductor's C++ backend fails on the 1x128 / 1x32 block reshapes of these emulated quantisers
    (AssertionError in CppScheduling.try_loop_split: two fused nodes end with different loop
    ranges after the split; no config switch avoids it) after one to two minutes of compiling, so
    the run is refused at start. On CUDA the Triton backend compiles them.
    """
    import torch

    if tcfg.compile and device.type == "cpu" and recipe.name in NO_CPU_COMPILE:
        raise ConfigError(
            f"trainer.compile=true on CPU cannot compile recipe {recipe.name}: the C++ backend of torch.compile "
            f"(torch {torch.__version__}) fails on its block-scaled quantisers after minutes of compiling. On CPU "
            "use trainer.compile=false (the emulation computes the same numbers), or compile on a GPU "
            f"(trainer.device=cuda); recipes that compile on CPU: "
            + ", ".join(r for r in ("bf16", "delayed", "tensorwise") if r != recipe.name)
        )


def check_memory(tcfg: TrainerConfig, mcfg: "ModelConfig", recipe, device: "torch.device", *, world_size: int,
                 bf16_activations: bool) -> None:
    """Refuse a run whose estimated training memory does not fit ``device``, naming what would
    fit (:func:`nemo_fp8_recipes.memory.check_fits`); ``trainer.memory_check=false`` skips it."""
    if not tcfg.memory_check:
        return
    from .memory import check_fits

    distributed = world_size > 1
    shard = world_size if distributed and tcfg.data_parallel == "fsdp2" else 1
    too_big = check_fits(mcfg, device, tokens_per_micro_batch=tcfg.micro_batch_size * tcfg.seq_len,
                         fp8=recipe.is_fp8, activation_bytes=2 if bf16_activations else 4, shard=shard,
                         where=f" with micro-batches of {tcfg.micro_batch_size} x {tcfg.seq_len} tokens"
                               + (" per rank" if distributed else ""))
    if too_big:
        raise ConfigError(too_big)
