"""How runs are named: the run directory's leaf, ``<recipe>[-<tag>][-<key><value>...]``, from the
recipe, ``run.tag`` and the keys of ``run.sweep`` (the keys a sweep varies, so every job of
``nemo-fp8-train -m ... trainer.seed=1,2,3`` has its own run: ``bf16-seed1``, ``bf16-seed2``, ...),
and the ``fp8.run_name`` resolver the configs name runs with."""

from __future__ import annotations

import re
from typing import Any, List, Optional, Sequence

__all__ = ["run_name", "register_resolvers", "swept_keys", "with_sweep_names"]


def _override_key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


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
    """Run directory leaf: ``<recipe>[-<tag>]``, then one ``-<key><value>`` per key of ``sweep``
    (``run.sweep``; the values are read from the config, ``_root_``), e.g. ``bf16-seed1``."""
    from omegaconf import OmegaConf

    tag = "" if tag is None else str(tag).strip()
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

