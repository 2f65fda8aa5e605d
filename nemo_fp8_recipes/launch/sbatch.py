"""Talking to SLURM: submitting a rendered script with ``sbatch --parsable`` and reading the job id
(:func:`submit_script`), asking ``scontrol`` then ``sacct`` for a job's state (:func:`job_state`),
polling until it ends (:func:`wait_for_job`), and the atomic JSON record of a submission
(:func:`write_json`). Each command has a timeout; a missing or failing one raises
:class:`SbatchError` with its output. The scripts themselves are made by
:mod:`nemo_fp8_recipes.launch.slurm`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

__all__ = [
    "SbatchError",
    "JobState",
    "TERMINAL_STATES",
    "parse_job_id",
    "submit_script",
    "job_state",
    "wait_for_job",
    "write_json",
]


class SbatchError(RuntimeError):
    """``sbatch`` (or ``scontrol``/``sacct``) failed or is missing; the message has its output."""


# ---- sbatch / scontrol ---------------------------------------------------------------------------
_JOB_ID_RE = re.compile(r"(\d+)(?:;[A-Za-z0-9._-]+)?")


def parse_job_id(output: str) -> str:
    """The job id from ``sbatch --parsable`` (``123`` or ``123;cluster``) or plain ``sbatch``
    (``Submitted batch job 123``) output."""
    text = output.strip()
    for line in reversed(text.splitlines()):
        line = line.strip()
        m = _JOB_ID_RE.fullmatch(line) or re.search(r"Submitted batch job (\d+)", line)
        if m:
            return m.group(1)
    raise SbatchError(f"could not read a job id from sbatch's output: {text!r}")


def _run(
    cmd: Sequence[str], *, timeout: float = 60.0, env: Optional[Mapping[str, str]] = None
) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=timeout, env=dict(env) if env is not None else None
        )
    except FileNotFoundError:
        raise SbatchError(
            f"'{cmd[0]}' not found: run on a SLURM login node (or set submit.sbatch to its path); "
            "submit.dry_run=true prints the script without submitting"
        ) from None
    except subprocess.TimeoutExpired:
        raise SbatchError(f"'{' '.join(cmd)}' did not answer within {timeout:.0f} s (is slurmctld up?)") from None


def submit_script(script: Union[str, Path], *, sbatch: str = "sbatch", env: Optional[Mapping[str, str]] = None) -> str:
    """Submit ``script`` with ``sbatch --parsable``; return the job id. Raises :class:`SbatchError`
    with sbatch's own message when it refuses the job."""
    proc = _run([sbatch, "--parsable", str(script)], env=env)
    if proc.returncode != 0:
        raise SbatchError(f"sbatch refused {script} (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
    return parse_job_id(proc.stdout)


#: SLURM job states after which the job will not run again.
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)


@dataclass(frozen=True)
class JobState:
    """A job's state as SLURM reports it: ``state`` (e.g. ``RUNNING``, ``COMPLETED``), the exit
    code ``exit_code`` (``"0:0"`` = code:signal) and where the answer came from."""

    job_id: str
    state: str
    exit_code: Optional[str] = None
    reason: Optional[str] = None
    source: str = "scontrol"

    @property
    def done(self) -> bool:
        """Whether the job has finished (successfully or not)."""
        return self.state in TERMINAL_STATES

    @property
    def ok(self) -> bool:
        """Finished with state COMPLETED and exit code 0."""
        return self.state == "COMPLETED" and (self.exit_code in (None, "0:0", "0"))


def _scontrol_state(job_id: str, env) -> Optional[JobState]:
    proc = _run(["scontrol", "show", "job", "-o", str(job_id)], env=env, timeout=30)
    if proc.returncode != 0 or "JobState=" not in proc.stdout:
        return None
    fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
    return JobState(
        job_id=str(job_id),
        state=fields.get("JobState", "UNKNOWN").rstrip("+"),
        exit_code=fields.get("ExitCode"),
        reason=fields.get("Reason"),
        source="scontrol",
    )


def _sacct_state(job_id: str, env) -> Optional[JobState]:
    try:
        proc = _run(["sacct", "-n", "-X", "-P", "-o", "State,ExitCode", "-j", str(job_id)], env=env, timeout=30)
    except SbatchError:
        return None
    if proc.returncode != 0:
        return None
    for line in proc.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 2 and parts[0]:
            state = parts[0].split()[0].rstrip("+")  # "CANCELLED by 0" -> CANCELLED
            return JobState(job_id=str(job_id), state=state, exit_code=parts[1], source="sacct")
    return None


def job_state(job_id: str, *, env: Optional[Mapping[str, str]] = None) -> JobState:
    """Ask ``scontrol show job`` (live and recently finished jobs), then ``sacct`` (accounting,
    if the cluster has it). ``state='UNKNOWN'`` when neither knows the job."""
    return (
        _scontrol_state(job_id, env)
        or _sacct_state(job_id, env)
        or JobState(job_id=str(job_id), state="UNKNOWN", source="none")
    )


def wait_for_job(
    job_id: str, *, timeout_s: float = 0.0, poll_s: float = 2.0, env: Optional[Mapping[str, str]] = None, on_change=None
) -> JobState:
    """Poll :func:`job_state` until the job reaches a terminal state; return it.

    ``timeout_s=0`` waits forever; otherwise :class:`TimeoutError` names the last state.
    ``on_change(state)`` is called whenever the state changes (progress printing).
    """
    deadline = time.monotonic() + timeout_s if timeout_s and timeout_s > 0 else None
    last: Optional[str] = None
    unknown_since: Optional[float] = None
    while True:
        st = job_state(job_id, env=env)
        if st.state != last:
            last = st.state
            if on_change is not None:
                on_change(st)
        if st.done:
            return st
        if st.state == "UNKNOWN":
            unknown_since = unknown_since or time.monotonic()
            if time.monotonic() - unknown_since > 60:
                raise SbatchError(f"job {job_id} is unknown to scontrol and sacct (purged, or another cluster?)")
        else:
            unknown_since = None
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {st.state} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def write_json(path: Union[str, Path], data) -> None:
    """Write ``data`` as indented JSON (atomically: temp file + rename)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)
