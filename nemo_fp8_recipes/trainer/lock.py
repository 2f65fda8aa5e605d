"""One trainer per run directory: ``<run dir>/.lock`` names the process that trains there.

Two trainers writing one directory would interleave checkpoints, config and events from both.
The lock is a file created with ``O_EXCL`` (atomic on local and network file systems, where
``flock`` is not), holding the host, PID and start time of its owner; it is removed when the
run ends, however it ends. A lock left by a process that no longer exists on this host (a
``kill -9``, a crashed node's job restarted here) is taken over with a warning; one held by a live
process, or by another host (whose processes cannot be seen from here), is refused, naming it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Iterator, Optional

from .result import TrainingError

__all__ = ["LOCK_NAME", "RunDirLocked", "run_dir_lock"]

log = logging.getLogger("nemo_fp8_recipes.train")

LOCK_NAME = ".lock"


class RunDirLocked(TrainingError):
    """Another trainer holds the run directory."""


def _read(path: Path) -> Optional[dict]:
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user
        return True
    return True


def _create(path: Path, info: dict) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(info, f)
    return True


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[Path]:
    """Hold ``run_dir``'s lock while the block runs; :class:`RunDirLocked` when another trainer
    holds it (module docstring)."""
    path = Path(run_dir) / LOCK_NAME
    host = socket.gethostname()
    info = {"host": host, "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    for _ in range(3):  # a stale lock taken over, or one that vanished between two looks
        if _create(path, info):
            break
        other = _read(path)
        if other is None:  # being written this instant, or damaged: look again once it settles
            time.sleep(0.2)
            other = _read(path)
            if other is None:
                raise RunDirLocked(
                    f"{path} exists but is not a lock this trainer wrote; if no trainer runs in {run_dir}, "
                    "delete it and start again"
                )
        who = f"PID {other.get('pid')} on {other.get('host')} (since {other.get('started')})"
        if other.get("host") == host and (other.get("pid") == os.getpid() or not _alive(other.get("pid"))):
            left_by = (
                "an earlier Trainer of this process that was not closed"
                if other.get("pid") == os.getpid()
                else f"{who}, which no longer runs"
            )
            log.warning("run directory lock %s was left by %s; taking it over", path, left_by)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        where = "this host" if other.get("host") == host else f"host {other.get('host')}"
        raise RunDirLocked(
            f"another trainer is running in {run_dir}: {who}. Two trainers in one run directory would mix "
            f"their checkpoints and curves: wait for it, give this run another run.tag, or, if that process "
            f"is gone from {where}, delete {path}"
        )
    else:
        raise RunDirLocked(f"could not take the lock {path}: other trainers keep taking it")
    try:
        yield path
    finally:
        if _read(path) == info:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
