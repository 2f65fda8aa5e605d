"""Planning ``nemo-fp8-submit`` jobs: the ``cluster`` and ``submit`` config blocks as dataclasses,
``-m`` sweeps expanded into one override list per job (:func:`expand_sweep`), the overrides the
trainer gets on the nodes (:func:`trainer_overrides`), and one composed config turned into a
:class:`~nemo_fp8_recipes.launch.slurm.SlurmJob` with its rendered script (:func:`plan_job`,
:func:`plan_jobs`), including the Megatron-Bridge launch line and its pre-launch check. Nothing
here writes a file or runs a SLURM command; :mod:`nemo_fp8_recipes.launch.submit` does."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import itertools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..config import (
    ConfigError,
    checked_config,
    override_value,
    run_name,
    typed_config,
    with_sweep_names,
)
from .slurm import (
    ContainerSpec,
    ShellExpr,
    SlurmJob,
    SlurmSpecError,
    check_arg,
    check_job_name,
    check_path,
    check_program,
    check_word,
    render_sbatch,
    torchrun_args,
)

__all__ = [
    "SlurmClusterConfig",
    "ContainerConfig",
    "SubmitConfig",
    "BridgeLaunchConfig",
    "PlannedJob",
    "BRIDGE_PRESETS",
    "expand_sweep",
    "plan_job",
    "plan_jobs",
    "trainer_overrides",
]

PROG = "nemo-fp8-submit"
BACKENDS = ("native", "te", "megatron_bridge")

BRIDGE_ENTRIES = ("nemo_fp8", "run_recipe")
#: Megatron-Bridge mixed-precision preset per recipe key (docs/megatron.md), for ``entry=run_recipe``.
BRIDGE_PRESETS = {
    "bf16": "bf16_mixed",
    "delayed": "bf16_with_fp8_delayed_scaling_mixed",
    "tensorwise": "bf16_with_fp8_current_scaling_mixed",
    "blockwise": "bf16_with_fp8_subchannel_scaling_mixed",
    "mxfp8": "bf16_with_mxfp8_mixed",
}


# ---- typed config blocks ----------------------------------------------------------------------
@dataclass
class ContainerConfig:
    """``cluster.container``: pyxis image, mounts and working directory."""

    image: Optional[str] = None
    mounts: List[str] = field(default_factory=list)
    auto_mounts: bool = True
    workdir: Optional[str] = None
    mount_home: bool = False


@dataclass
class SlurmClusterConfig:
    """The ``cluster`` block of ``configs/cluster/slurm.yaml`` (see the comments there)."""

    name: str
    nodes: int
    gpus_per_node: int
    gpu_type: str
    cpus_per_task: Optional[int]
    mem: Optional[str]
    partition: Optional[str]
    account: Optional[str]
    qos: Optional[str]
    time: Optional[str]
    signal_lead_s: Optional[int]
    exclusive: bool
    job_name: Optional[str]
    chdir: Optional[str]
    python: Optional[str]
    torchrun: Optional[str]
    master_port: int
    sbatch_args: Dict[str, Any]
    container: ContainerConfig
    env: Dict[str, Optional[str]]


@dataclass
class BridgeLaunchConfig:
    """``submit.bridge``: how the ``backend=megatron_bridge`` launch line is built."""

    entry: str = "nemo_fp8"
    dir: str = "/opt/Megatron-Bridge"
    mixed_precision: Optional[str] = None
    dataset: str = "llm-pretrain-mock"


@dataclass
class SubmitConfig:
    """The ``submit`` block of ``train.yaml`` (see the comments there)."""

    dry_run: bool
    sbatch: str
    wait: bool
    wait_timeout_s: float
    bridge: BridgeLaunchConfig


@dataclass
class PlannedJob:
    """One job ready to submit: the spec, the rendered script and where it goes."""

    job: SlurmJob
    script: str
    run_dir: Path
    overrides: List[str]
    backend: str
    submit: SubmitConfig
    warnings: List[str] = field(default_factory=list)

    @property
    def script_path(self) -> Path:
        """``<run dir>/submit.sbatch``."""
        return self.run_dir / "submit.sbatch"


# ---- overrides ------------------------------------------------------------------------------------
def _parse(overrides: Sequence[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        return OverridesParser.create().parse_overrides(overrides=list(overrides))
    except OverrideParseException as e:
        first = str(e).splitlines()[0] if str(e) else "could not parse the overrides"
        raise ConfigError(
            f"{first}\nHydra override syntax: quote a value that has special characters (# , = spaces "
            "quotes), inside shell quotes, e.g. \"cluster.container.image='nvcr.io#nvidia/nemo:25.04'\""
        ) from None


def expand_sweep(overrides: Sequence[str], multirun: bool) -> List[List[str]]:
    """Overrides -> one override list per job (Hydra's basic-sweeper semantics: the cartesian
    product of every ``key=a,b,c`` / ``range()`` / ``choice()`` sweep, in the order given).

    Without ``multirun`` a sweep is an error that says to add ``-m``.
    """
    lists: List[List[str]] = []
    for o in _parse(overrides):
        key = o.get_key_element()
        if o.is_sweep_override():
            values = list(o.sweep_string_iterator())
            if not multirun:
                raise ConfigError(
                    f"'{o.input_line}' sweeps {len(values)} values; add -m to submit one job per value "
                    f"({PROG} -m {o.input_line} ...)"
                )
            lists.append([f"{key}={v}" for v in values])
        else:
            lists.append([o.input_line])
    return [list(combo) for combo in itertools.product(*lists)] if lists else [[]]


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def trainer_overrides(overrides: Sequence[str], run_root: Path, run_dir_overridden: Optional[Path]) -> List[str]:
    """The overrides the trainer gets on the nodes: yours, minus ``cluster*``, ``submit*``,
    ``hydra*`` and ``run.root``/``run.dir``, plus ``cluster=local`` (each process trains on its
    node) and the absolute ``run.root`` (and ``run.dir`` if you set it), so the job writes exactly
    where this command said it would, whatever its working directory."""
    out = []
    for o in overrides:
        key = _override_key(o)
        head = key.split(".", 1)[0].split("/", 1)[0]
        if head in ("cluster", "submit", "hydra") or key in ("run.root", "run.dir"):
            continue
        out.append(o)
    out.append("cluster=local")
    out.append(f"run.root={override_value(run_root)}")
    if run_dir_overridden is not None:
        out.append(f"run.dir={override_value(run_dir_overridden)}")
    return out


# ---- planning --------------------------------------------------------------------------------------
def _default_torchrun(python: str) -> str:
    sibling = Path(python).with_name("torchrun")
    return str(sibling) if sibling.is_file() and os.access(sibling, os.X_OK) else "torchrun"


def _absolute(path: str, base: Path) -> Path:
    p = Path(os.path.expanduser(path))
    return Path(os.path.normpath(p if p.is_absolute() else base / p))


def plan_job(
    cfg, overrides: Sequence[str], *, framework_overrides: Sequence[str] = (), cwd: Optional[Path] = None
) -> PlannedJob:
    """Turn one composed config (+ the overrides that made it, and for ``backend=megatron_bridge``
    the pass-through overrides that are Bridge's) into a :class:`PlannedJob`.

    Pure apart from reading the config: nothing is written or submitted. Raises
    :class:`~nemo_fp8_recipes.config.ConfigError` (incl. :class:`SlurmSpecError`) with the
    key and what is allowed.
    """
    from ..config import build_recipe, run_config, trainer_config

    cwd = Path(cwd or os.getcwd())
    if cfg.cluster.get("name") != "slurm":
        raise ConfigError(
            f"{PROG} submits to SLURM, but cluster={cfg.cluster.get('name')}; use cluster=slurm "
            "(the default here), or nemo-fp8-train to train on this machine"
        )
    cl: SlurmClusterConfig = typed_config(cfg.get("cluster"), SlurmClusterConfig, "cluster")
    sub: SubmitConfig = typed_config(cfg.get("submit"), SubmitConfig, "submit")
    trainer_config(cfg)
    rcfg = run_config(cfg)
    recipe = build_recipe(cfg.recipe)  # validates the recipe; the hardware check runs on the nodes
    backend = str(cfg.backend.name)
    if backend not in BACKENDS:
        raise ConfigError(f"{PROG} launches backend=native, te or megatron_bridge, got backend={backend}")
    if framework_overrides and backend != "megatron_bridge":
        raise ConfigError(
            f"overrides {list(framework_overrides)} are not nemo-fp8-train keys (they pass "
            "through to Megatron-Bridge only with backend=megatron_bridge)"
        )

    run_dir = _absolute(rcfg.dir, cwd)
    run_root = _absolute(rcfg.root, cwd)
    run_dir_overridden = run_dir if any(_override_key(o) == "run.dir" for o in overrides) else None
    chdir = _absolute(cl.chdir, cwd) if cl.chdir else cwd
    model = cfg.model.name
    gpu_type = check_word(cl.gpu_type, "cluster.gpu_type", "a GPU name such as H100")
    check_path(str(run_dir), "run.dir (made from run.root, model, recipe and run.tag)")
    if cl.job_name:
        job_name = check_job_name(str(cl.job_name))
    else:
        size = f"{cl.nodes * cl.gpus_per_node}x{gpu_type}" if cl.gpus_per_node > 0 else f"{cl.nodes}xcpu"
        job_name = check_job_name(
            f"{model}-{size}-{run_name(recipe.name, rcfg.tag, rcfg.sweep, _root_=cfg)}",
            "the job name derived from model, GPUs, recipe and run.tag (or set cluster.job_name)",
        )

    image = cl.container.image
    python = check_program(cl.python or ("python" if image else sys.executable), "cluster.python")
    torchrun = check_program(cl.torchrun or ("torchrun" if image else _default_torchrun(python)), "cluster.torchrun")

    env = {str(k): v for k, v in (cl.env or {}).items()}
    if backend in ("te", "megatron_bridge"):
        from ..integrations.te import te_env

        # Transformer Engine reads these once, at import; the native backend has no TE.
        for k, v in te_env(recipe).items():
            if env.get(k) is not None and str(env[k]) != v:
                raise SlurmSpecError(
                    f"cluster.env.{k}={env[k]!r} contradicts recipe {recipe.name} "
                    f"(scale_rounding={recipe.scale_rounding.value} needs {k}={v}); drop it or set "
                    "recipe.scale_rounding instead"
                )
            env[k] = v

    if cl.gpus_per_node == 0 and cl.cpus_per_task and env.get("OMP_NUM_THREADS") is None:
        # CPU jobs: PyTorch would start a thread per core of the node and oversubscribe the CPUs
        # SLURM gave this job (torchrun does the same for multi-process GPU jobs).
        env["OMP_NUM_THREADS"] = str(cl.cpus_per_task)
    warnings: List[str] = []
    variables: Dict[str, str] = {}
    comment = [
        f"Rendered by {PROG} on {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC from:",
        "  " + " ".join([PROG, *overrides, *framework_overrides]),
        f"model {model}, recipe {recipe.name}, backend {backend}, {cl.nodes} node(s) x {cl.gpus_per_node} GPU(s)",
    ]
    if backend in ("native", "te"):  # the embedded trainer (te: with Transformer Engine's linears)
        args = trainer_overrides(overrides, run_root, run_dir_overridden)
        if cl.gpus_per_node == 0 and cl.nodes == 1:
            command = [python, "-m", "nemo_fp8_recipes.train", *args]
            comment.append("CPU job: one plain python process (no torchrun, no GPUs)")
        elif cl.gpus_per_node == 0:
            command = [*torchrun_args(torchrun, 1), "-m", "nemo_fp8_recipes.train", *args]
            comment.append(
                f"CPU job on {cl.nodes} nodes: one process per node, data parallel over gloo "
                f"(trainer.data_parallel={cfg.trainer.data_parallel})"
            )
        else:
            command = [*torchrun_args(torchrun, cl.gpus_per_node), "-m", "nemo_fp8_recipes.train", *args]
            n = cl.nodes * cl.gpus_per_node
            if n > 1:
                comment.append(
                    f"{n} processes (one per GPU), data parallel: trainer.data_parallel="
                    f"{cfg.trainer.data_parallel}; rank 0 writes the run directory"
                )
    else:
        args, bridge_warnings = _bridge_command(
            cfg, recipe, sub.bridge, framework_overrides, overrides, run_dir, cl, env, variables, comment
        )
        warnings += bridge_warnings
        command = [*torchrun_args(torchrun, cl.gpus_per_node), *args]
    comment += [f"WARNING: {w}" for w in warnings]
    mounts = list(cl.container.mounts)
    if image and cl.container.auto_mounts:
        for p in (str(run_root), str(chdir)):
            if not any(m.split(":")[0] == p for m in mounts):
                mounts.append(p)
    container = ContainerSpec(
        image=image,
        mounts=tuple(mounts),
        workdir=cl.container.workdir or (str(chdir) if image else None),
        mount_home=cl.container.mount_home,
    )
    job = SlurmJob(
        job_name=job_name,
        run_dir=str(run_dir),
        command=tuple(command),
        nodes=cl.nodes,
        gpus_per_node=cl.gpus_per_node,
        partition=cl.partition,
        account=cl.account,
        qos=cl.qos,
        time=cl.time,
        signal_lead_s=cl.signal_lead_s if backend in ("native", "te") else None,
        mem=cl.mem,
        cpus_per_task=cl.cpus_per_task,
        exclusive=cl.exclusive,
        chdir=str(chdir),
        sbatch_args=dict(cl.sbatch_args or {}),
        env=env,
        container=container,
        master_port=cl.master_port,
        variables=variables,
        comment=tuple(comment),
    )
    job.validate()  # the script's own fields first, then the trainer's checks
    if backend in ("native", "te"):
        trainer_warnings = check_trainer_job(cfg, cl, recipe)
        if trainer_warnings:
            warnings += trainer_warnings
            job = dataclasses.replace(job, comment=job.comment + tuple(f"WARNING: {w}" for w in trainer_warnings))
    script = render_sbatch(job)
    return PlannedJob(
        job=job, script=script, run_dir=run_dir, overrides=list(args), backend=backend, submit=sub, warnings=warnings
    )


def check_trainer_job(cfg, cl: SlurmClusterConfig, recipe) -> List[str]:
    """The trainer's own start-up checks for the job's world size, before anything is submitted:
    the global batch splits over every rank, and the memory estimate per GPU fits the GPU that
    ``cluster.gpu_type`` names (where its memory is known; otherwise a warning). Raises
    :class:`ConfigError`; returns the warnings."""
    import torch
    from omegaconf import OmegaConf

    from ..config import trainer_config
    from ..hardware import GPUS, gpu_by_key
    from ..models import ModelConfig
    from ..trainer.checks import check_batch_split, check_memory

    tcfg = trainer_config(cfg)
    world = cl.nodes * max(1, cl.gpus_per_node)
    check_batch_split(tcfg, world)
    if cl.gpus_per_node == 0 or not tcfg.memory_check:
        return []
    gpu = gpu_by_key(str(cl.gpu_type))
    if gpu is None or gpu.memory_gb is None:
        known = ", ".join(g.key for g in GPUS if g.memory_gb)
        return [
            f"memory per GPU not checked: cluster.gpu_type={cl.gpu_type} is not a GPU whose memory is known ({known})"
        ]
    check_memory(
        tcfg,
        ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True)),
        recipe,
        torch.device("cuda"),
        world_size=world,
        bf16_activations=True,
        available=int(0.95 * gpu.memory_gb * 1e9),
        device_name=f"an {gpu.name} ({gpu.memory_gb:g} GB)",
    )
    return []


def _bridge_command(
    cfg,
    recipe,
    br: BridgeLaunchConfig,
    theirs: Sequence[str],
    overrides: Sequence[str],
    run_dir: Path,
    cl: SlurmClusterConfig,
    env: Dict[str, str],
    variables: Dict[str, str],
    comment: List[str],
) -> Tuple[List[str], List[str]]:
    """The program + arguments torchrun starts for ``backend=megatron_bridge``, and warnings.
    Runs the pre-launch validator for ``cluster.gpu_type`` (errors refuse the job)."""
    from ..integrations.bridge.recipes import bridge_recipe_name
    from ..integrations.validate import parse_gpu, validate_config

    if cl.gpus_per_node < 1:
        raise ConfigError("backend=megatron_bridge needs GPUs: set cluster.gpus_per_node >= 1")
    if br.entry not in BRIDGE_ENTRIES:
        raise ConfigError(f"submit.bridge.entry={br.entry!r} is not valid; choose one of: {', '.join(BRIDGE_ENTRIES)}")
    from ..integrations.bridge.recipes import provider_mode

    try:
        mode = provider_mode(str(cfg.model.name), cfg.backend.get("provider", "auto"), cfg.backend.get("recipe_fn"))
        fn = bridge_recipe_name(str(cfg.model.name), cfg.backend.get("recipe_fn")) if mode == "recipe" else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if fn is not None:
        check_word(fn, "backend.recipe_fn", "a recipe function name of megatron.bridge.recipes")
    elif br.entry == "run_recipe":
        raise ConfigError(
            f"submit.bridge.entry=run_recipe runs a Bridge recipe function, and model={cfg.model.name} "
            "is built from our model config (backend.provider=ours); use submit.bridge.entry=nemo_fp8, "
            "or name a function with backend.recipe_fn=<name>"
        )
    for o in theirs:
        check_arg(o, "Megatron-Bridge override")

    # The validator of nemo-fp8-check, for the GPUs the job asks for (not this machine).
    try:
        device = parse_gpu(cl.gpu_type)
    except ValueError:
        device = None
    report = validate_config(cfg, list(theirs), device=device, te_version=None, environ=env)
    if report.errors:
        raise ConfigError(f"the pre-launch check refuses this job (cluster.gpu_type={cl.gpu_type}):\n" + report.table())
    warnings = [
        f"pre-launch check: {f.message}"
        for f in report.warnings
        if device is not None or "hardware" not in str(getattr(f, "code", ""))
    ]
    if device is None:
        warnings.append(
            f"cluster.gpu_type={cl.gpu_type} is not a GPU the pre-launch check knows; set it to e.g. "
            "H100, H200 or B200 so the recipe is checked against the nodes' GPUs"
        )

    from ..integrations.bridge.launch import check_world_size, launch_plan
    from ..integrations.bridge.recipes import BridgeLaunchError

    try:
        plan = launch_plan(cfg, list(theirs), [o for o in overrides if not _override_key(o).startswith("cluster")])
        par = plan.get("parallel")
        if par:
            check_world_size(
                par["tensor_parallel"],
                par["pipeline_parallel"],
                par["context_parallel"],
                plan.get("recipe_fn") or f"model={plan['model']}",
                world=cl.nodes * cl.gpus_per_node,
            )
    except BridgeLaunchError as e:
        raise ConfigError(
            f"{e} (the job asks for cluster.nodes={cl.nodes} x cluster.gpus_per_node={cl.gpus_per_node})"
        ) from None
    built = "recipe " + plan["recipe_fn"] if plan.get("recipe_fn") else "built from our model config (offline)"
    comment.append(
        f"Megatron-Bridge model: {built}" + (f", {par['gpus_per_replica']} GPU(s) per replica" if par else "")
    )
    given = {o.split("=", 1)[0].lstrip("+~") for o in theirs}
    dirs = [
        a
        for k, a in (
            ("logger.tensorboard_dir", f"logger.tensorboard_dir={run_dir}"),
            ("checkpoint.save", f"checkpoint.save={run_dir}/checkpoints"),
        )
        if k not in given
    ]
    if br.entry == "nemo_fp8":
        ours = [
            o
            for o in overrides
            if _override_key(o).split(".", 1)[0].split("/", 1)[0] not in ("cluster", "submit", "hydra", "run")
        ]
        if not any(_override_key(o) == "backend" for o in ours):
            ours.append("backend=megatron_bridge")
        ours.append(f"run.dir={run_dir}")  # audit.txt where this command says the run directory is
        comment.append(
            f"Megatron-Bridge {'recipe ' + fn if fn else 'with our model config'}, FP8 recipe {recipe.name} "
            "applied through mixed_precision (nemo_fp8_recipes.integrations.bridge)"
        )
        return ["-m", "nemo_fp8_recipes.integrations.bridge", *ours, *theirs, *dirs], warnings

    preset = br.mixed_precision or BRIDGE_PRESETS[recipe.name]
    check_word(preset, "submit.bridge.mixed_precision", "a mixed-precision preset name")
    check_word(br.dataset, "submit.bridge.dataset", "a run_recipe.py --dataset choice")
    variables["BRIDGE_DIR"] = check_path(br.dir, "submit.bridge.dir")
    warnings.append(
        f"submit.bridge.entry=run_recipe runs Bridge's preset {preset} with its own FP8 settings (e.g. amax "
        "history 1 for delayed); recipe.* tunables and policy.* are not applied. submit.bridge.entry=nemo_fp8 "
        "applies them"
    )
    comment.append(f"Megatron-Bridge run_recipe.py: recipe {fn}, mixed precision preset {preset}")
    return [
        ShellExpr('"$BRIDGE_DIR/scripts/training/run_recipe.py"'),
        "--recipe",
        fn,
        "--dataset",
        br.dataset,
        f"mixed_precision={preset}",
        *dirs,
        *theirs,
    ], warnings


def _with_cluster_default(overrides: Sequence[str]) -> List[str]:
    if any(_override_key(o) == "cluster" for o in overrides):
        return list(overrides)
    return ["cluster=slurm", *overrides]


def _backend_of(overrides: Sequence[str]) -> str:
    for o in overrides:
        if _override_key(o) == "backend" and "=" in o:
            return o.split("=", 1)[1]
    return "native"


def plan_jobs(overrides: Sequence[str], *, multirun: bool = False, cwd: Optional[Path] = None) -> List[PlannedJob]:
    """Compose and plan every job of ``overrides`` (``cluster=slurm`` unless given; a ``-m`` sweep
    gives one job per combination). Raises ConfigError before anything is written."""
    for o in overrides:
        check_arg(o, "override")
        key = _override_key(o)
        if key.startswith("hydra"):
            raise ConfigError(
                f"'{o}': {PROG} renders its own sbatch scripts and takes no hydra.* overrides. For Hydra's "
                "submitit launcher use the trainer: nemo-fp8-train -m hydra/launcher=submitit_nemo ..."
            )
    # every job of a sweep gets its own run directory, named by the keys swept (run.sweep)
    combos = expand_sweep(with_sweep_names(_with_cluster_default(overrides)), multirun)
    jobs = []
    for combo in combos:
        ours, theirs = list(combo), []
        if _backend_of(combo) == "megatron_bridge":
            from ..integrations.validate import split_overrides

            ours, theirs = split_overrides(combo, backend="megatron_bridge")
        cfg, problem = checked_config(ours)  # (what depends on the machine is checked on the nodes)
        if problem:
            raise ConfigError(problem)
        jobs.append(plan_job(cfg, ours, framework_overrides=theirs, cwd=cwd))
    dirs = [j.run_dir for j in jobs]
    dup = sorted({str(d) for d in dirs if dirs.count(d) > 1})
    if dup:
        raise ConfigError(
            f"several jobs of this sweep would share a run directory ({', '.join(dup)}); sweep over "
            "run.tag too (e.g. run.tag=a,b) so every job gets its own"
        )
    return jobs
