"""SLURM batch scripts: validated job specs and their rendering.

This module knows SLURM and the shell, nothing about Hydra: :mod:`nemo_fp8_recipes.launch.submit`
turns a composed config into a :class:`SlurmJob` and calls :func:`render_sbatch` /
:func:`submit_script` / :func:`wait_for_job`. Submission and job polling (``sbatch``,
``scontrol``, ``sacct``) are in :mod:`nemo_fp8_recipes.launch.sbatch`, re-exported here.

A rendered script has four parts, in this order (see :func:`render_sbatch`):

1. the ``#SBATCH`` header: job name, nodes, tasks per node (always 1: ``torchrun`` starts the
   per-GPU processes), GPUs per node (left out for CPU jobs), partition, account, QoS, time,
   memory, exclusive, working directory and the log file ``<run dir>/slurm-%j.out``;
2. a usage comment (how it was made and how to re-submit it);
3. a ``CONFIG`` block: shell variables (run directory, container image and mounts, rendezvous
   port, Megatron-Bridge checkout) and the exported NCCL / Transformer Engine / PyTorch
   environment;
4. the launch line: ``srun --ntasks-per-node=1 [pyxis container flags] <command>``.

Safety: every value that reaches the shell is quoted with :func:`shlex.quote`; values that
reach ``#SBATCH`` lines (which ``sbatch`` parses itself, not the shell) or that pyxis splits
(mount lists) must match strict patterns, and a value with a quote, a newline or another
character outside its pattern is rejected with :class:`SlurmSpecError` naming what is allowed —
never escaped into something that might still be interpreted. The only unquoted pieces of the
launch line are the SLURM/rendezvous variables this module writes itself
(``$SLURM_NNODES``, ``$MASTER_ADDR``, ``$MASTER_PORT``, ``$SLURM_JOB_ID``, ``$BRIDGE_DIR``,
``$CONTAINER_*``), marked :class:`ShellExpr`.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..config import ConfigError

__all__ = [
    "SlurmSpecError",
    "ShellExpr",
    "ContainerSpec",
    "SlurmJob",
    "check_arg",
    "check_word",
    "check_job_name",
    "check_partition",
    "check_account",
    "check_time",
    "check_path",
    "check_env",
    "check_mount",
    "check_program",
    "reserved_sbatch_option",
    "render_sbatch",
    "render_command",
    "torchrun_args",
]


class SlurmSpecError(ConfigError):
    """A value that cannot go into an sbatch script; the message says what is allowed."""


class ShellExpr(str):
    """A piece of shell this module writes itself (a ``$VAR`` reference): rendered unquoted.

    Everything else in a command is a literal and is quoted with :func:`shlex.quote`.
    """


# ---- validation ----------------------------------------------------------------------------------
_JOB_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_PARTITION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(,[A-Za-z0-9][A-Za-z0-9._-]*)*")
_TIME_RE = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE")
_MEM_RE = re.compile(r"\d+[KMGT]?")
_PATH_RE = re.compile(r"[A-Za-z0-9._/+@=~-]+")
_IMAGE_RE = re.compile(r"[A-Za-z0-9._/:@#+-]+")
_MOUNT_FLAGS_RE = re.compile(r"[a-z]+(\+[a-z]+)*")
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SBATCH_OPT_RE = re.compile(r"[a-z][a-z0-9-]*")
_SBATCH_VALUE_RE = re.compile(r"[A-Za-z0-9._:,=/@+%-]*")
_WORD_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")

_PATH_CHARS = "letters, digits and . _ / + @ = ~ - (no spaces, quotes, commas, colons, $ or newlines)"


def _describe(value) -> str:
    return repr(value)


def _need(pattern: re.Pattern, value, key: str, allowed: str) -> str:
    text = "" if value is None else str(value)
    if not pattern.fullmatch(text):
        raise SlurmSpecError(
            f"{key}={_describe(value)} is not allowed: {allowed}. Values are checked, not escaped, "
            "so a quote, space or newline can never reach the sbatch script"
        )
    return text


def check_job_name(name: str, key: str = "cluster.job_name") -> str:
    """A SLURM job name: 1-128 of ``[A-Za-z0-9._+-]``, starting with a letter or digit."""
    return _need(
        _JOB_NAME_RE,
        name,
        key,
        "use 1-128 characters from letters, digits and . _ + -, starting with a letter or digit",
    )


def check_partition(value: str, key: str = "cluster.partition") -> str:
    """One partition or a comma-separated list, each ``[A-Za-z0-9][A-Za-z0-9._-]*``."""
    return _need(
        _PARTITION_RE, value, key, "use a partition name (letters, digits, . _ -) or a comma-separated list of them"
    )


def check_account(value: str, key: str = "cluster.account") -> str:
    """An account or QoS name: ``[A-Za-z0-9][A-Za-z0-9._-]*`` (at most 128 characters)."""
    return _need(_NAME_RE, value, key, "use 1-128 characters from letters, digits and . _ -")


def check_time(value, key: str = "cluster.time") -> str:
    """A SLURM time limit: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``."""
    return _need(
        _TIME_RE, value, key, "use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 04:00:00 or 2-00:00:00)"
    )


def check_path(value, key: str) -> str:
    """A filesystem path that is safe on an ``#SBATCH`` line and in pyxis mount lists."""
    return _need(_PATH_RE, value, key, f"use a path made of {_PATH_CHARS}")


#: variables the script may not export: the shell's own (they change how it parses the script and
#: runs programs), the script's (set in its CONFIG block) and SLURM's (srun reads them)
_SHELL_VARIABLES = frozenset(
    {"IFS", "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "CDPATH", "GLOBIGNORE", "PROMPT_COMMAND"}
    | {"POSIXLY_CORRECT"}
)
_SCRIPT_VARIABLES = frozenset({"RUN_DIR", "MASTER_ADDR", "MASTER_PORT", "CONTAINER_IMAGE", "CONTAINER_MOUNTS"})


def check_env(env: Mapping[str, object], key: str = "cluster.env") -> Dict[str, str]:
    """Environment variables: names ``[A-Za-z_][A-Za-z0-9_]*``, none of the shell's, the script's
    or SLURM's own (``IFS``, ``MASTER_ADDR``, ``SLURM_*`` ...); values any text without a newline
    or NUL (they are quoted with :func:`shlex.quote` when exported). ``None`` values are dropped."""
    out: Dict[str, str] = {}
    for k, v in env.items():
        _need(_ENV_KEY_RE, k, f"{key} name", "use letters, digits and _, not starting with a digit")
        if k in _SHELL_VARIABLES or k in _SCRIPT_VARIABLES or k.startswith(("SLURM_", "SBATCH_", "SRUN_")):
            whose = (
                "the shell's own (it changes how the script is read and run)"
                if k in _SHELL_VARIABLES
                else "set by the script itself (cluster.master_port, the run directory, the container)"
                if k in _SCRIPT_VARIABLES
                else "SLURM's (sbatch and srun read it; use cluster.* or cluster.sbatch_args)"
            )
            raise SlurmSpecError(f"{key}.{k} cannot be exported by the job script: the variable is {whose}")
        if v is None:
            continue
        if isinstance(v, bool):
            v = "1" if v else "0"
        if not isinstance(v, (str, int, float)):
            raise SlurmSpecError(
                f"{key}.{k}={v!r} is not allowed: an environment variable holds one string, not a "
                f"{type(v).__name__}; quote it for Hydra if the commas are meant literally, e.g. "
                f"\"{key}.{k}='a,b'\""
            )
        text = str(v)
        if "\n" in text or "\r" in text or "\0" in text:
            raise SlurmSpecError(f"{key}.{k}={text!r} is not allowed: values must be one line (no newline or NUL)")
        out[str(k)] = text
    return out


_PROGRAM_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]*")


def check_program(value, key: str) -> str:
    """A program ``srun`` starts (``cluster.python``, ``cluster.torchrun``): an absolute path, or a
    plain name looked up on the nodes' ``PATH``. ``~`` and ``~user`` are expanded here (the
    script is rendered for the submitting user); a relative path with a ``/`` is refused (it
    would be looked up from the job's working directory, which is easy to get wrong), and so is
    anything starting with ``-``, which ``srun`` would read as one of its own options. Returns the
    program as it goes into the script."""
    text = "" if value is None else str(value)
    if text.startswith("~"):
        expanded = os.path.expanduser(text)
        if expanded.startswith("~"):
            raise SlurmSpecError(f"{key}={text!r}: no such user's home directory to expand; give an absolute path")
        text = expanded
    if text.startswith("-"):
        raise SlurmSpecError(
            f"{key}={text!r} is not a program: srun would read it as one of its own options. Give the program's "
            "absolute path (e.g. /opt/venv/bin/python) or its name on the nodes' PATH (python); srun options "
            "go in cluster.sbatch_args or cluster.env"
        )
    if "/" in text:
        if not os.path.isabs(text):
            raise SlurmSpecError(
                f"{key}={text!r} is a relative path, which the job would resolve from its working directory; give "
                f"the absolute path (e.g. {os.path.abspath(text)}) or a plain program name on the nodes' PATH"
            )
        return check_path(text, key)
    return _need(
        _PROGRAM_NAME_RE,
        text,
        key,
        "use an absolute path or a program name (letters, digits and . _ + -, not starting with -)",
    )


def check_mount(mount: str, key: str = "cluster.container.mounts") -> str:
    """A pyxis mount ``SRC[:DST[:FLAGS]]``; paths as :func:`check_path`, flags like ``ro``."""
    text = str(mount)
    parts = text.split(":")
    ok = (
        1 <= len(parts) <= 3
        and all(_PATH_RE.fullmatch(p) for p in parts[:2])
        and (len(parts) < 3 or _MOUNT_FLAGS_RE.fullmatch(parts[2]) is not None)
    )
    if not ok:
        raise SlurmSpecError(
            f"{key} entry {text!r} is not allowed: use SRC[:DST[:FLAGS]] with paths made of {_PATH_CHARS} "
            "and FLAGS like ro or rw (pyxis splits the list on commas and colons)"
        )
    return text


def check_word(value, key: str, what: str) -> str:
    return _need(_WORD_RE, value, key, f"use {what}: letters, digits and _ . - (starting with a letter, digit or _)")


def check_arg(value, key: str) -> str:
    text = str(value)
    if "\n" in text or "\r" in text or "\0" in text:
        raise SlurmSpecError(f"{key} {text!r} is not allowed: arguments must be one line (no newline or NUL)")
    return text


# ---- the job -------------------------------------------------------------------------------------
# Options render_sbatch writes itself; cluster.sbatch_args may not set them behind its back —
# neither by name nor by an abbreviation (sbatch, like getopt_long, takes any unambiguous prefix
# of a long option: --outp is --output).
_OWN_SBATCH_OPTIONS = {
    "job-name": "cluster.job_name",
    "nodes": "cluster.nodes",
    "ntasks-per-node": "(always 1)",
    "gpus-per-node": "cluster.gpus_per_node",
    "partition": "cluster.partition",
    "account": "cluster.account",
    "qos": "cluster.qos",
    "time": "cluster.time",
    "mem": "cluster.mem",
    "cpus-per-task": "cluster.cpus_per_task",
    "exclusive": "cluster.exclusive",
    "output": "(the run directory)",
    "error": "(the run directory)",
    "chdir": "cluster.chdir",
    "signal": "cluster.signal_lead_s",
}
# sbatch long options that are proper prefixes of one of ours but name another option themselves
# (an exact name wins over an abbreviation): --gpus is not --gpus-per-node.
_OTHER_SBATCH_OPTIONS_PREFIXING_OURS = frozenset({"gpus", "ntasks"})
# sbatch's other names for options of ours (SLURM keeps --tasks-per-node as a deprecated alias)
_SBATCH_ALIASES = {"tasks-per-node": "ntasks-per-node"}


def reserved_sbatch_option(opt: str) -> Optional[str]:
    """The option of ours that ``#SBATCH --<opt>`` would set (its full name), or None: the name
    itself, or any prefix of it that sbatch would expand to it (or reject as ambiguous)."""
    if opt in _OWN_SBATCH_OPTIONS:
        return opt
    if opt in _SBATCH_ALIASES:
        return _SBATCH_ALIASES[opt]
    if opt in _OTHER_SBATCH_OPTIONS_PREFIXING_OURS:
        return None
    hits = sorted(o for o in _OWN_SBATCH_OPTIONS if o.startswith(opt))
    return hits[0] if hits else None


@dataclass(frozen=True)
class ContainerSpec:
    """pyxis/enroot container settings. ``image=None``: no container flags at all."""

    image: Optional[str] = None
    mounts: Tuple[str, ...] = ()
    workdir: Optional[str] = None
    mount_home: bool = False

    def validate(self) -> "ContainerSpec":
        """Check every field (raises :class:`SlurmSpecError`)."""
        if self.image is not None:
            _need(
                _IMAGE_RE,
                self.image,
                "cluster.container.image",
                "use an image reference made of letters, digits and . _ / : @ # + - "
                "(e.g. nvcr.io#nvidia/nemo:25.04 or /shared/images/nemo.sqsh)",
            )
        for m in self.mounts:
            check_mount(m)
        if self.workdir is not None:
            check_path(self.workdir, "cluster.container.workdir")
        return self


@dataclass(frozen=True)
class SlurmJob:
    """Everything an sbatch script needs. Build it, call :meth:`validate`, then :func:`render_sbatch`.

    ``command`` is the program ``srun`` starts on every node (one task per node): a list of
    literals (quoted) and :class:`ShellExpr` pieces (not quoted). ``run_dir`` receives the script
    and the log ``slurm-<jobid>.out``.
    """

    job_name: str
    run_dir: str
    command: Tuple[str, ...]
    nodes: int = 1
    gpus_per_node: int = 0
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: Optional[str] = None
    mem: Optional[str] = None
    cpus_per_task: Optional[int] = None
    exclusive: bool = False
    chdir: Optional[str] = None
    signal_lead_s: Optional[int] = None
    sbatch_args: Mapping[str, object] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    container: ContainerSpec = field(default_factory=ContainerSpec)
    master_port: int = 29500
    variables: Mapping[str, str] = field(default_factory=dict)
    comment: Tuple[str, ...] = ()

    @property
    def log_pattern(self) -> str:
        """The ``--output`` path (``%j`` = job id)."""
        return f"{self.run_dir}/slurm-%j.out"

    def log_path(self, job_id: str) -> Path:
        """The log file of submitted job ``job_id``."""
        return Path(self.log_pattern.replace("%j", str(job_id)))

    def validate(self) -> "SlurmJob":
        """Check every field; raises :class:`SlurmSpecError` naming the key and what is allowed."""
        check_job_name(self.job_name)
        check_path(self.run_dir, "run.dir (absolute)")
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise SlurmSpecError(f"cluster.nodes must be an integer >= 1, got {self.nodes!r}")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 0:
            raise SlurmSpecError(
                f"cluster.gpus_per_node must be an integer >= 0 (0 = CPU job), got {self.gpus_per_node!r}"
            )
        if self.cpus_per_task is not None and (not isinstance(self.cpus_per_task, int) or self.cpus_per_task < 1):
            raise SlurmSpecError(f"cluster.cpus_per_task must be null or an integer >= 1, got {self.cpus_per_task!r}")
        if not isinstance(self.master_port, int) or not 1024 <= self.master_port <= 65535:
            raise SlurmSpecError(f"cluster.master_port must be an integer in 1024..65535, got {self.master_port!r}")
        if self.partition is not None:
            check_partition(self.partition)
        if self.account is not None:
            check_account(self.account)
        if self.qos is not None:
            check_account(self.qos, "cluster.qos")
        if self.time is not None:
            check_time(self.time)
        lead = self.signal_lead_s
        if lead is not None and (isinstance(lead, bool) or not isinstance(lead, int) or not 0 <= lead <= 65535):
            raise SlurmSpecError(
                f"cluster.signal_lead_s must be null or whole seconds in 0..65535 (SLURM's limit), got {lead!r}"
            )
        if self.mem is not None:
            _need(_MEM_RE, self.mem, "cluster.mem", "use an integer with an optional K, M, G or T suffix (0 = all)")
        if self.chdir is not None:
            check_path(self.chdir, "cluster.chdir")
        for opt, value in self.sbatch_args.items():
            _need(
                _SBATCH_OPT_RE,
                opt,
                "cluster.sbatch_args option",
                "use the long option name without dashes, e.g. reservation or constraint",
            )
            ours = reserved_sbatch_option(opt)
            if ours == opt:
                raise SlurmSpecError(
                    f"cluster.sbatch_args.{opt} is rendered from {_OWN_SBATCH_OPTIONS[opt]}; set that instead"
                )
            if ours is not None:
                raise SlurmSpecError(
                    f"cluster.sbatch_args.{opt}: sbatch reads --{opt} as an abbreviation of --{ours}, which is "
                    f"rendered from {_OWN_SBATCH_OPTIONS[ours]}; set that instead (give other sbatch options "
                    "by their full name)"
                )
            if not isinstance(value, bool):
                _need(
                    _SBATCH_VALUE_RE,
                    value,
                    f"cluster.sbatch_args.{opt}",
                    "use letters, digits and . _ : , = / @ + % - (or true for a flag)",
                )
        check_env(self.env)
        for k, v in self.variables.items():
            _need(_ENV_KEY_RE, k, "script variable", "use letters, digits and _")
            check_arg(v, f"script variable {k}")
        for a in self.command:
            if not isinstance(a, ShellExpr):
                check_arg(a, "launch argument")
        if not self.command:
            raise SlurmSpecError("the launch command is empty")
        for c in self.comment:
            check_arg(c, "script comment (an override?)")
        self.container.validate()
        return self


# ---- rendering -----------------------------------------------------------------------------------
def render_command(args: Sequence[str]) -> str:
    """Join a command for the shell: literals quoted with :func:`shlex.quote`, :class:`ShellExpr`
    pieces as they are."""
    return " ".join(a if isinstance(a, ShellExpr) else shlex.quote(str(a)) for a in args)


def torchrun_args(torchrun: str, gpus_per_node: int) -> List[str]:
    """``torchrun`` with a c10d rendezvous on the first node of the allocation (every node runs
    the same line; ``$MASTER_ADDR``/``$MASTER_PORT`` are set by the script's CONFIG block)."""
    return [
        torchrun,
        ShellExpr('"--nnodes=$SLURM_NNODES"'),
        f"--nproc-per-node={gpus_per_node}",
        "--rdzv-backend=c10d",
        ShellExpr('"--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT"'),
        ShellExpr('"--rdzv-id=$SLURM_JOB_ID"'),
    ]


def _wrap(line: str, width: int = 100, indent: str = "  ") -> str:
    """Break a long shell command at argument boundaries with backslash continuations."""
    words = _split_top_level(line)
    out, cur = [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            out.append(cur + " \\")
            cur = indent + w
        else:
            cur = f"{cur} {w}" if cur else w
    out.append(cur)
    return "\n".join(out)


def _split_top_level(line: str) -> List[str]:
    """Split on spaces that are outside single/double quotes (quoting produced by shlex.quote)."""
    words, cur, quote = [], [], None
    for ch in line:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
            cur.append(ch)
        elif ch == " ":
            if cur:
                words.append("".join(cur))
                cur = []
        else:
            cur.append(ch)
    if cur:
        words.append("".join(cur))
    return words


def render_sbatch(job: SlurmJob) -> str:
    """The complete sbatch script for ``job`` (validated first). Pure: no file, no subprocess."""
    job.validate()
    sb = [f"#SBATCH --job-name={job.job_name}", f"#SBATCH --nodes={job.nodes}", "#SBATCH --ntasks-per-node=1"]
    if job.gpus_per_node > 0:
        sb.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_task is not None:
        sb.append(f"#SBATCH --cpus-per-task={job.cpus_per_task}")
    for opt, value in (
        ("partition", job.partition),
        ("account", job.account),
        ("qos", job.qos),
        ("time", job.time),
        ("mem", job.mem),
    ):
        if value is not None:
            sb.append(f"#SBATCH --{opt}={value}")
    if job.exclusive:
        sb.append("#SBATCH --exclusive")
    if job.signal_lead_s:
        # SIGTERM to every process of the job this long before its time limit: the trainer finishes
        # its step and saves (otherwise SLURM's SIGTERM comes at the limit, KillWait before SIGKILL)
        sb.append(f"#SBATCH --signal=TERM@{job.signal_lead_s}")
    if job.chdir is not None:
        sb.append(f"#SBATCH --chdir={job.chdir}")
    sb.append(f"#SBATCH --output={job.log_pattern}")
    sb.append(f"#SBATCH --error={job.log_pattern}")
    for opt, value in job.sbatch_args.items():
        if isinstance(value, bool):
            if value:
                sb.append(f"#SBATCH --{opt}")
        else:
            sb.append(f"#SBATCH --{opt}={value}")

    lines = ["#!/bin/bash", *sb, "#"]
    lines += [f"# {c}" if c else "#" for c in job.comment]
    lines += [
        "#",
        f"# Usage: sbatch {job.run_dir}/submit.sbatch   (re-render with nemo-fp8-submit rather than edit)",
        "",
        "set -euo pipefail",
        "",
        "# ---- CONFIG ----",
        f"RUN_DIR={shlex.quote(job.run_dir)}",
    ]
    if job.container.image is not None:
        lines.append(f"CONTAINER_IMAGE={shlex.quote(job.container.image)}")
        lines.append(f"CONTAINER_MOUNTS={shlex.quote(','.join(job.container.mounts))}")
    for k, v in job.variables.items():
        lines.append(f"{k}={shlex.quote(v)}")
    lines.append(f"MASTER_PORT={job.master_port}")
    lines.append('MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)" || true')
    lines.append(': "${MASTER_ADDR:?cannot resolve the first node of $SLURM_JOB_NODELIST with scontrol}"')
    lines.append("export MASTER_ADDR MASTER_PORT")
    for k, v in job.env.items():
        lines.append(f"export {k}={shlex.quote(v)}")

    srun: List[str] = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if job.container.image is not None:
        srun.append(ShellExpr('--container-image="$CONTAINER_IMAGE"'))
        if job.container.mounts:
            srun.append(ShellExpr('--container-mounts="$CONTAINER_MOUNTS"'))
        if job.container.workdir is not None:
            srun.append(f"--container-workdir={job.container.workdir}")
        if not job.container.mount_home:
            srun.append("--no-container-mount-home")
    launch = render_command(srun + list(job.command))
    lines += [
        "",
        'echo "[$(date -u +%FT%TZ)] job $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES node(s) ($SLURM_JOB_NODELIST), '
        'rendezvous $MASTER_ADDR:$MASTER_PORT, run dir $RUN_DIR"',
        "",
        "# ---- LAUNCH ----",
        _wrap(launch),
        "",
    ]
    return "\n".join(lines)
