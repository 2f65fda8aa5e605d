"""Atomic training checkpoints and RNG state capture for exact resume.

A checkpoint is one ``torch.save`` file, ``<dir>/step_<NNNNNNNN>.pt``, written to a temporary
name in the same directory, flushed and fsynced, then ``os.replace``-d into place (and the
directory fsynced). A crash or a kill at any point leaves either the old set of checkpoints or
the old set plus the new one — never a truncated file under a checkpoint name; stray temporary
files are ignored on load and removed on the next successful save.

Everything stored is a tensor, a container or a Python scalar/string, so checkpoints load with
``torch.load(weights_only=True)`` (no arbitrary code runs when a checkpoint is read).

Every checkpoint carries checksums of its own content (:func:`state_checksums`: a CRC32 of each
tensor's bytes, by its path in the state, and one of every other value), written with it in the
same file and verified by :func:`load_checkpoint`. A flipped byte in the optimizer state, a
truncated or an empty file is refused with :class:`CheckpointError` naming what does not match;
:meth:`CheckpointManager.last_good` finds the newest older checkpoint that loads and verifies, so
the error can name it. A disk that fills up during a save raises :class:`CheckpointError` saying
so; the previous checkpoints are untouched.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import numpy as np
import torch

from .._io import fsync_dir as _fsync_dir
from ..config import TrainerConfig
from ..models.config import ModelConfig
from .distributed import load_state_dicts

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "save_checkpoint",
    "load_checkpoint",
    "state_checksums",
    "capture_rng_state",
    "restore_rng_state",
]

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^step_(\d{8,})\.pt$")
_TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked (missing, unreadable, or from another run)."""


_CHECKSUM_KEY = "checksums"
_CHECKSUM_ALGORITHM = "crc32"


def _leaves(obj: Any, path: str, tensors: Dict[str, str], values: List[str]) -> None:
    if torch.is_tensor(obj):
        t = obj.detach()
        t = (t.cpu() if t.device.type != "cpu" else t).contiguous().reshape(-1)
        crc = zlib.crc32(t.view(torch.uint8).numpy()) if t.numel() else 0
        tensors[path] = f"{crc & 0xFFFFFFFF:08x} {str(obj.dtype).replace('torch.', '')} {list(obj.shape)}"
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _leaves(v, f"{path}.{k}" if path else str(k), tensors, values)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _leaves(v, f"{path}[{i}]", tensors, values)
    else:
        values.append(f"{path}={obj!r}")


def state_checksums(state: Dict[str, Any]) -> Dict[str, Any]:
    """Checksums of a checkpoint state: ``{"algorithm": "crc32", "tensors": {path: "<crc32>
    <dtype> <shape>"}, "values": <crc32 of every non-tensor value and its path>}``. The
    ``checksums`` entry itself is left out, so a loaded state checks against what it carries."""
    tensors: Dict[str, str] = {}
    values: List[str] = []
    _leaves({k: v for k, v in state.items() if k != _CHECKSUM_KEY}, "", tensors, values)
    return {
        "algorithm": _CHECKSUM_ALGORITHM,
        "tensors": tensors,
        "values": zlib.crc32("\n".join(values).encode("utf-8")) & 0xFFFFFFFF,
    }


def _verify(state: Dict[str, Any], path: Path) -> None:
    stored = state.pop(_CHECKSUM_KEY, None)
    if stored is None:
        log.warning("%s carries no checksums (written by an older version): loaded without verification", path)
        return
    if not isinstance(stored, dict) or stored.get("algorithm") != _CHECKSUM_ALGORITHM:
        raise CheckpointError(f"{path} is corrupt: its checksum record is unreadable")
    now = state_checksums(state)
    want = stored.get("tensors", {})
    bad = sorted(k for k in set(want) | set(now["tensors"]) if want.get(k) != now["tensors"].get(k))
    if stored.get("values") != now["values"]:
        bad.append("(non-tensor values: step, config, RNG state, ...)")
    if bad:
        raise CheckpointError(
            f"{path} is corrupt: {len(bad)} entr{'y does' if len(bad) == 1 else 'ies do'} not match the checksums "
            f"written with it ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})"
        )


def _disk_full(e: BaseException, directory: Path) -> bool:
    """Whether a failed write failed for want of space: ENOSPC/EDQUOT, or a write error of
    torch.save's zip writer (a RuntimeError without an errno) on a filesystem with no room left.
    Call it before the partial file is removed."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if not isinstance(e, (OSError, RuntimeError)):
        return False
    if "No space left on device" in str(e):
        return True
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def save_checkpoint(state: Dict[str, Any], path: Union[str, Path]) -> Path:
    """Write ``state`` and its :func:`state_checksums` to ``path`` atomically (temp file in the
    same dir + fsync + os.replace). ``state`` itself is not modified.

    If anything fails while writing, the temporary file is removed and ``path`` is untouched
    (the previous file at ``path``, if any, stays valid). A full disk raises
    :class:`CheckpointError` saying so. Returns ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{_TMP_PREFIX}{path.name}.{os.getpid()}.{time.monotonic_ns()}"
    payload = {**state, _CHECKSUM_KEY: state_checksums(state)}
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        full = _disk_full(e, path.parent)
        try:
            tmp.unlink()
        except OSError:
            pass
        if full:
            raise CheckpointError(
                f"disk full while writing checkpoint {path.name} in {path.parent} "
                f"({e if isinstance(e, OSError) else 'no space left on the device'}); nothing was replaced: "
                "the older checkpoints there are intact. Free space, lower trainer.ckpt_keep, write elsewhere "
                "(run.root=...), or turn checkpoints off with trainer.checkpoint=false"
            ) from e
        raise
    _fsync_dir(path.parent)
    return path


def load_checkpoint(path: Union[str, Path], map_location: Union[str, torch.device] = "cpu") -> Dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (``weights_only=True``) and verify
    its checksums; the returned state does not hold them. A missing, empty, truncated or corrupt
    file raises :class:`CheckpointError` saying which."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes): not a checkpoint")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the path and the cause
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(
            f"cannot read checkpoint {path} (truncated or corrupt?): {type(e).__name__}: {first}"
        ) from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a checkpoint of this trainer (it holds a {type(state).__name__})")
    _verify(state, path)
    return state


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

    @staticmethod
    def step_of(path: Path) -> Optional[int]:
        """The step of a checkpoint file name, or None."""
        m = _NAME_RE.match(Path(path).name)
        return int(m.group(1)) if m else None

    def last_good(self, before: Optional[Path] = None, check=None) -> Optional[Path]:
        """The newest checkpoint (older than ``before`` if given) that loads and verifies (and
        passes ``check(state, path)``, which raises :class:`CheckpointError`), or None. Reads each
        candidate in full: meant for the error path."""
        limit = self.step_of(before) if before is not None else None
        for p in reversed(self.list()):
            if limit is not None and (self.step_of(p) or 0) >= limit:
                continue
            try:
                state = load_checkpoint(p)
                if check is not None:
                    check(state, p)
            except CheckpointError:
                continue
            return p
        return None

    def supersede_after(self, step: int) -> List[Path]:
        """Rename the checkpoints of steps after ``step`` to ``<name>.superseded-<time>`` (kept, no
        longer listed): a run resumed from an older checkpoint of this directory continues from it,
        and a later ``trainer.resume=auto`` follows the new trajectory. Returns the new paths."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        moved = []
        for p in self.list():
            if (self.step_of(p) or 0) > step:
                q = p.with_name(f"{p.name}.superseded-{stamp}")
                os.replace(p, q)
                moved.append(q)
        if moved:
            _fsync_dir(self.directory)
        return moved

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
                len(cuda),
                torch.cuda.device_count(),
            )


# ---- resuming the embedded trainer: which checkpoint, and whether it belongs to this run -----
#: state-dict leaves that are FP8 scaling state (ours: ``fp8_*`` buffers; TE's ``_extra_state``),
#: the part of a checkpoint that does not carry over between recipes or backends
FP8_STATE_MARKERS = ("fp8_", "_extra_state")
#: the trainer's checkpoint layout version (a checkpoint of another version is refused); 2: full
#: FQN-keyed model/optimizer state (any world size, DDP or FSDP2)
CHECKPOINT_FORMAT = 2


def is_fp8_state_key(key: str) -> bool:
    """Whether state-dict key ``key`` is FP8 scaling state (see :data:`FP8_STATE_MARKERS`)."""
    leaf = key.rsplit(".", 1)[-1]
    return leaf.startswith(FP8_STATE_MARKERS)


def load_model_state(
    model: torch.nn.Module,
    optimizer,
    state: Dict[str, torch.Tensor],
    optim_state: Optional[Dict[str, Any]],
    forced: bool,
) -> None:
    """Load a checkpoint's model and optimizer state. ``forced`` (a resume across recipes or
    backends): FP8 scaling state that does not match is dropped or starts fresh, with a warning;
    any other mismatch of the weights is refused."""
    result = load_state_dicts(model, optimizer, state, optim_state, strict=not forced)
    if not forced:
        return
    bad = [k for k in list(result.missing_keys) + list(result.unexpected_keys) if not is_fp8_state_key(k)]
    if bad:
        raise CheckpointError(f"checkpoint weights do not match the model: {bad[:8]}")
    dropped = len(result.unexpected_keys)
    fresh = len(result.missing_keys)
    if dropped or fresh:
        log.warning(
            "forced resume across recipes: %d FP8 state entries of the checkpoint dropped, %d initialised fresh",
            dropped,
            fresh,
        )


def resolve_resume(tcfg: TrainerConfig, mgr: CheckpointManager) -> Optional[Path]:
    """The checkpoint ``trainer.resume`` asks for (None: start fresh): ``auto`` the latest of the
    run's ``mgr``, ``never`` none (refused if the run directory already has checkpoints), or a
    file, or a run / checkpoint directory (its latest)."""
    if tcfg.resume == "never":
        existing = mgr.list()
        if existing:
            raise CheckpointError(
                f"{mgr.directory} already has checkpoints (latest {existing[-1].name}) but "
                "trainer.resume=never; use trainer.resume=auto to continue that run, run.tag=<name> "
                "for a new run directory, or delete the old run"
            )
        return None
    if tcfg.resume == "auto":
        return mgr.latest()
    p = Path(tcfg.resume).expanduser()
    if p.is_dir():
        latest = CheckpointManager(p / "checkpoints" if (p / "checkpoints").is_dir() else p).latest()
        if latest is None:
            raise CheckpointError(f"trainer.resume={tcfg.resume}: no checkpoint (step_*.pt) in that directory")
        return latest
    if not p.is_file():
        raise CheckpointError(f"trainer.resume={tcfg.resume}: no such checkpoint file")
    return p


#: what a checkpoint of this trainer holds at least (besides what check_compatible compares)
RESUME_KEYS = ("step", "model", "optimizer", "scheduler", "rng", "data")


def check_resumable(state: Dict[str, Any], path: Path) -> None:
    """A checkpoint this version of the trainer can resume: its format, and every part a resume
    restores; :class:`CheckpointError` naming what is wrong."""
    fmt = state.get("format")
    if fmt != CHECKPOINT_FORMAT:
        if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"{path}: checkpoint format {fmt} is newer than this version of nemo_fp8_recipes reads "
                f"({CHECKPOINT_FORMAT}): upgrade it (pip install -U nemo_fp8_recipes) to resume this run"
            )
        raise CheckpointError(
            f"{path}: checkpoint format {fmt!r}, and this version of nemo_fp8_recipes reads format "
            f"{CHECKPOINT_FORMAT} only"
        )
    missing = [k for k in RESUME_KEYS if k not in state]
    if missing:
        raise CheckpointError(
            f"{path}: the checkpoint has no {', '.join(missing)} (it verifies, but was not written whole by "
            "this trainer): it cannot be resumed"
        )


def load_for_resume(path: Path, tcfg: TrainerConfig) -> Dict[str, Any]:
    """Load and verify the checkpoint to resume from; a bad one is refused, naming the newest
    older checkpoint of its directory that loads and verifies (never a silent fall-back)."""
    try:
        # On the CPU: RNG states must stay CPU tensors; load_state_dict moves the rest.
        state = load_checkpoint(path, map_location="cpu")
        check_resumable(state, path)
        return state
    except CheckpointError as e:
        good = CheckpointManager(path.parent).last_good(before=path, check=check_resumable)
        how = (
            "trainer.resume=auto picked it as the latest" if tcfg.resume == "auto" else f"trainer.resume={tcfg.resume}"
        )
        if good is not None:
            fix = (
                f"The newest older checkpoint that loads and verifies is {good}: resume from it with "
                f"trainer.resume={good} (the later checkpoints of the directory are then kept aside as "
                "*.superseded-<time>), or move the bad file away"
            )
        else:
            fix = "No older checkpoint of that directory loads either: start a new run (run.tag=<name>)"
        raise CheckpointError(f"{e} ({how}). {fix}") from None


#: trainer settings an automatic resume must find unchanged (see :func:`check_compatible`)
RESUME_HYPERPARAMETERS = (
    "seed",
    "seq_len",
    "micro_batch_size",
    "global_batch_size",
    "lr",
    "min_lr",
    "warmup_steps",
    "weight_decay",
    "beta1",
    "beta2",
    "eps",
    "grad_clip",
    "autocast",
    "compile",
    "compile_mode",
)


def _flat(prefix: str, value: Any) -> Dict[str, Any]:
    if isinstance(value, dict):
        out: Dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(f"{prefix}.{k}", v))
        return out
    return {prefix: value}


def check_compatible(
    ckpt: Dict[str, Any],
    path: Path,
    recipe,
    mcfg: ModelConfig,
    tcfg: TrainerConfig,
    fingerprint: str,
    auto: bool = False,
    backend: str = "native",
    settings: Optional[Dict[str, Any]] = None,
) -> bool:
    """Refuse a checkpoint from another recipe (unless forced) or model shape; refuse an
    *automatic* resume whose trainer hyperparameters or ``settings`` (``{"policy": ...,
    "kernels": ...}``, compared with those the checkpoint recorded) changed (e.g. two jobs of a
    ``-m trainer.lr=...`` sweep sharing a run directory) unless forced; warn on data changes.
    ``ckpt`` comes from :func:`load_for_resume` (its format and parts already checked). Returns
    whether the FP8 state must be loaded non-strictly."""
    old_model = ckpt.get("model_config", {})
    diffs = [
        f"{k}: {old_model.get(k)!r} -> {v!r}"
        for k, v in mcfg.to_dict().items()
        if k != "name" and old_model.get(k) != v
    ]
    if diffs:
        raise CheckpointError(f"{path} was written for another model shape ({'; '.join(diffs)})")
    old_recipe = ckpt.get("recipe", {})
    forced = False
    old_backend, new_backend = str(ckpt.get("backend", "native")), str(backend)
    if old_backend != new_backend:
        if not tcfg.force_resume:
            raise CheckpointError(
                f"{path} was written by backend={old_backend}, this run uses backend={new_backend}. The weights "
                "map one to one between the backends, their FP8 scaling state does not (our amax histories vs "
                "Transformer Engine's extra state): pass trainer.force_resume=true to load the weights and "
                "optimizer and start the FP8 state fresh, or resume with the same backend"
            )
        forced = True
        log.warning(
            "forced resume across backends (%s -> %s): FP8 scaling state starts fresh", old_backend, new_backend
        )
    if old_recipe.get("name") != recipe.name:
        if not tcfg.force_resume:
            raise CheckpointError(
                f"{path} was written with recipe {old_recipe.get('name')!r}, this run uses "
                f"{recipe.name!r}. Resume with the same recipe, start a new run (run.tag=<name>), or "
                "pass trainer.force_resume=true to load its weights and optimizer anyway (FP8 "
                "scaling state that does not apply is dropped)"
            )
        forced = True
        log.warning("forced resume: checkpoint recipe %s, this run %s", old_recipe.get("name"), recipe.name)
    elif old_recipe != recipe.describe():
        changed = sorted(
            k for k in set(old_recipe) | set(recipe.describe()) if old_recipe.get(k) != recipe.describe().get(k)
        )
        if not tcfg.force_resume:
            raise CheckpointError(
                f"{path} was written with different {recipe.name} settings ({', '.join(changed)}); "
                "pass trainer.force_resume=true to continue with the new settings"
            )
        forced = True
    data = ckpt.get("data", {})
    if data.get("fingerprint") != fingerprint:
        log.warning("the training data changed since %s: the resumed run will not match an uninterrupted one", path)
    old_t = ckpt.get("trainer", {})
    changed = [
        f"trainer.{k}: {old_t[k]!r} -> {getattr(tcfg, k)!r}"
        for k in RESUME_HYPERPARAMETERS
        if k in old_t and old_t[k] != getattr(tcfg, k)
    ]
    old_s = ckpt.get("settings") or {}
    for block, value in (settings or {}).items():
        if block in old_s:  # (checkpoints of earlier versions did not record it)
            old_f, new_f = _flat(block, old_s[block]), _flat(block, value)
            for k in sorted(set(old_f) | set(new_f)):
                if old_f.get(k) != new_f.get(k):
                    changed.append(f"{k}: {old_f.get(k)!r} -> {new_f.get(k)!r}")
    if changed and auto and not tcfg.force_resume:
        raise CheckpointError(
            f"{path.parent.parent} holds a run with other settings ({'; '.join(changed)}), "
            "so it is not resumed automatically (two jobs of a sweep over them would share it). "
            "Use run.tag=<name> for a separate run, or trainer.resume=<checkpoint> / "
            "trainer.force_resume=true to continue that run with the new settings"
        )
    for c in changed:
        log.warning("%s changed since the checkpoint; the current value is used", c)
    if "max_steps" in old_t and old_t["max_steps"] != tcfg.max_steps:
        log.info(
            "trainer.max_steps: %r -> %r (the cosine schedule follows the new value)",
            old_t["max_steps"],
            tcfg.max_steps,
        )
    return forced
