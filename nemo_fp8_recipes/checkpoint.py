"""Atomic training checkpoints and RNG state capture for exact resume.

A checkpoint is one ``torch.save`` file, ``<dir>/step_<NNNNNNNN>.pt``, written to a temporary
name in the same directory, flushed and fsynced, then ``os.replace``-d into place (and the
directory fsynced). A crash or a kill at any point leaves either the old set of checkpoints or
the old set plus the new one — never a truncated file under a checkpoint name; stray temporary
files are ignored on load and removed on the next successful save.

Everything stored is a tensor, a container or a Python scalar/string, so checkpoints load with
``torch.load(weights_only=True)`` (no arbitrary code runs when a checkpoint is read).
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import numpy as np
import torch
from ._io import fsync_dir as _fsync_dir

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "save_checkpoint",
    "load_checkpoint",
    "capture_rng_state",
    "restore_rng_state",
]

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^step_(\d{8,})\.pt$")
_TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked (missing, unreadable, or from another run)."""


def save_checkpoint(state: Dict[str, Any], path: Union[str, Path]) -> Path:
    """Write ``state`` to ``path`` atomically (temp file in the same dir + fsync + os.replace).

    If anything fails while writing, the temporary file is removed and ``path`` is untouched
    (the previous file at ``path``, if any, stays valid). Returns ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{_TMP_PREFIX}{path.name}.{os.getpid()}.{time.monotonic_ns()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


def load_checkpoint(path: Union[str, Path], map_location: Union[str, torch.device] = "cpu") -> Dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (``weights_only=True``)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the path and the cause
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") from e


class CheckpointManager:
    """The checkpoints of one run directory: ``save``, ``latest``, retention of the last ``keep``."""

    def __init__(self, directory: Union[str, Path], keep: int = 2) -> None:
        self.directory = Path(directory)
        self.keep = max(1, int(keep))

    def path_for(self, step: int) -> Path:
        """File name of the checkpoint at ``step``."""
        return self.directory / f"step_{int(step):08d}.pt"

    def list(self) -> List[Path]:
        """Complete checkpoints, oldest first (temporary files are not listed)."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = _NAME_RE.match(p.name)
            if m and p.is_file():
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def latest(self) -> Optional[Path]:
        """The most recent complete checkpoint, or None."""
        ckpts = self.list()
        return ckpts[-1] if ckpts else None

    def save(self, step: int, state: Dict[str, Any]) -> Path:
        """Save ``state`` as the checkpoint of ``step`` atomically, then prune old ones and stale
        temporary files (only after the new checkpoint is safely in place)."""
        path = save_checkpoint(state, self.path_for(step))
        for old in self.list()[: -self.keep]:
            try:
                old.unlink()
            except OSError as e:  # pragma: no cover - e.g. read-only files
                log.warning("could not delete old checkpoint %s: %s", old, e)
        for p in self.directory.iterdir():
            if p.name.startswith(_TMP_PREFIX) and not _writer_alive(p):
                try:
                    p.unlink()
                except OSError:
                    pass
        return path


def _writer_alive(tmp: Path) -> bool:
    """Whether the process that is writing temporary file ``tmp`` still runs (this host)."""
    try:
        pid = int(tmp.name.rsplit(".", 2)[1])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False  # our own saves are finished by the time we prune
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- RNG state ------------------------------------------------------------------------------
def capture_rng_state() -> Dict[str, Any]:
    """Python, NumPy, torch CPU and (if initialised) CUDA generator states, in
    ``weights_only``-loadable form."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    state: Dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "name": np_state[0],
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning(
                "checkpoint has %d CUDA RNG states, this machine has %d devices: CUDA RNG not restored",
                len(cuda), torch.cuda.device_count(),
            )
