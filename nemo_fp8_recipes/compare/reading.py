"""Reading ``nemo-fp8-compare``'s input: finding run directories (those holding TensorBoard
``events.out.tfevents.*`` files), checking every event file record by record, and reading one
scalar curve per run with TensorBoard's ``EventAccumulator`` (:func:`load_run`, :func:`load_runs`).
The definitions of the numbers computed from the curves are in :mod:`nemo_fp8_recipes.compare.cli`."""

from __future__ import annotations

import difflib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .seeds import read_run_config

__all__ = [
    "DEFAULT_TAG",
    "LOSS_TAGS",
    "TOKENS_TAG",
    "CompareError",
    "RunSeries",
    "find_runs",
    "resolve_run_dirs",
    "check_event_file",
    "load_run",
    "load_runs",
    "up_to_step",
    "run_names",
    "EVENTS_GLOB",
    "OUTPUT_MARKER",
]

DEFAULT_TAG = "train/loss"
#: The training loss as each trainer logs it: nemo-fp8-train, Megatron-Bridge / Megatron-LM,
#: NeMo 2 (``llm.pretrain`` through ``NeMoLogger``).
LOSS_TAGS = (DEFAULT_TAG, "lm loss", "reduced_train_loss")
TOKENS_TAG = "tokens_per_s"
EVENTS_GLOB = "events.out.tfevents.*"
OUTPUT_MARKER = "compare.json"  #: an output directory of this tool (never a run) holds it


class CompareError(ValueError):
    """A run, tag or baseline that cannot be used; the message lists what is available."""


# ---- finding and reading runs ---------------------------------------------------------------------
def _has_events(d: Path) -> bool:
    return d.is_dir() and any(d.glob(EVENTS_GLOB))


#: how many directory levels below a given parent runs are looked for
FIND_DEPTH = 3


def _first_deeper_run(parent: Path, found: Sequence[Path]) -> Optional[Path]:
    """A directory with event files more than :data:`FIND_DEPTH` levels below ``parent`` (not an
    output directory of this tool, nor below a run already found), or None."""
    parent = Path(parent)
    found_set = {Path(f) for f in found}
    for f in parent.rglob(EVENTS_GLOB):
        d = f.parent
        rel = d.relative_to(parent).parts
        if len(rel) <= FIND_DEPTH or any(part.startswith(".") for part in rel):
            continue
        chain = [parent.joinpath(*rel[:i]) for i in range(len(rel) + 1)]
        if any((c / OUTPUT_MARKER).is_file() for c in chain) or any(c in found_set for c in chain):
            continue
        return d
    return None


def find_runs(parent: Path, max_depth: int = FIND_DEPTH) -> List[Path]:
    """Directories under ``parent`` (itself included, ``max_depth`` levels down) that hold
    TensorBoard event files, sorted; output directories of this tool are skipped."""
    parent = Path(parent)
    found: List[Path] = []

    def walk(d: Path, depth: int) -> None:
        if (d / OUTPUT_MARKER).is_file():
            return
        if _has_events(d):
            found.append(d)
        if depth >= max_depth:
            return
        try:
            children = sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return
        for c in children:
            walk(c, depth + 1)

    if parent.is_dir():
        walk(parent, 0)
    return found


def _listing(parent: Path) -> str:
    runs = find_runs(parent)
    if not parent.is_dir():
        return f"{parent} does not exist either"
    if not runs:
        return f"no runs (directories with {EVENTS_GLOB} files) under {parent}"
    return f"runs found under {parent}: " + ", ".join(str(r.relative_to(parent)) or "." for r in runs)


def resolve_run_dirs(paths: Sequence[str]) -> List[Path]:
    """Command-line run arguments -> run directories. A directory with event files is a run; one
    without stands for every run below it. Errors list the runs found under the parent."""
    out: List[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise CompareError(f"no such run directory: {p}. {_listing(p.parent)}")
        if not p.is_dir():
            raise CompareError(f"{p} is not a directory (give run directories, not event files). {_listing(p.parent)}")
        if _has_events(p):
            out.append(p)
            continue
        below = find_runs(p)
        deeper = _first_deeper_run(p, below)
        if deeper is not None:
            print(
                f"nemo-fp8-compare: warning: runs more than {FIND_DEPTH} levels below {p} are not searched (e.g. "
                f"{deeper}): give their directory, or a parent closer to them",
                file=sys.stderr,
            )
        if not below:
            raise CompareError(f"no TensorBoard event files in {p} or below it. {_listing(p.parent)}")
        out.extend(below)
    seen, unique = set(), []
    for p in out:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    if not unique:
        raise CompareError("no runs given")
    return unique


@dataclass
class RunSeries:
    """One run's curve: ``steps`` (ascending) and ``values`` of ``tag``; ``tokens_per_s`` values
    (empty when not logged); ``tags``: every scalar tag of the run; ``problems``: damaged event
    files (:func:`check_event_file`), one line each; from its ``config.yaml``, what groups it with
    the same configuration's other seeds (:mod:`nemo_fp8_recipes.compare.seeds`)."""

    name: str
    path: str
    tag: str
    steps: List[int]
    values: List[float]
    tokens_per_s: List[float] = field(default_factory=list)
    tags: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)
    seed: Optional[int] = None  #: trainer.seed of its config.yaml (None: not a nemo-fp8-train run)
    deterministic: Optional[bool] = None  #: trainer.deterministic of its config.yaml
    variant: Optional[str] = None  #: what it trained, all but the seed (runs differing in the seed only share it)
    setting: Optional[str] = None  #: the same without its run tag (BF16 at other seeds shares BF16's)
    data_sha256: Optional[str] = None  #: its tokens' digest from summary.json (None: not recorded, or unfinished)


def _accumulator(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(
        str(path),
        size_guidance={"scalars": 0, "tensors": 1, "images": 1, "histograms": 1, "audio": 1, "compressedHistograms": 1},
    )
    acc.Reload()
    return acc


def check_event_file(path: Path) -> Optional[str]:
    """Walk every record of one event file with TensorBoard's own record reader (length header,
    masked CRC32C of the header and of the data). ``None`` if the file is whole; else one line
    saying where it breaks and how many records were readable before that. TensorBoard's
    ``EventAccumulator`` stops quietly at such a record, so a damaged file reads as a shorter run."""
    from tensorboard.compat.tensorflow_stub import errors
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

    path = Path(path)
    try:
        size = path.stat().st_size
        reader = PyRecordReader_New(str(path))
    except (OSError, errors.OpError) as e:
        return f"{path.name}: cannot be read ({e})"
    n = 0
    try:
        while True:
            try:
                reader.GetNext()
            except errors.OutOfRangeError:
                return None
            n += 1
    except errors.DataLossError as e:
        msg = str(getattr(e, "message", "") or e)
        what = "truncated" if "truncat" in msg.lower() else "corrupt"
        return (
            f"{path.name} is {what} after {n} readable record(s) ({size} bytes): {msg.strip()}; the steps "
            "after that point are missing"
        )
    finally:
        try:
            reader.file_handle.close()
        except Exception:  # noqa: BLE001 - best effort
            pass


def load_run(
    path: Path, tag: Optional[str] = None, tokens_tag: str = TOKENS_TAG, name: Optional[str] = None
) -> RunSeries:
    """Read ``tag`` (and ``tokens_tag`` if present) from the event files of run directory ``path``;
    every event file is checked record by record first (:func:`check_event_file`). ``tag=None``:
    the run's training loss under the name its trainer logs it (:data:`LOSS_TAGS`)."""
    path = Path(path)
    files = sorted(path.glob(EVENTS_GLOB))
    special = [f for f in files if not f.is_file()]
    if special:  # a FIFO or device would block the reader for ever
        raise CompareError(
            f"{special[0]} is not a regular file (a FIFO, device or directory named like an event file): "
            f"move it out of the run directory {path}"
        )
    problems = []
    for i, f in enumerate(files):
        problem = check_event_file(f)
        if problem and " is truncated after " in problem and i < len(files) - 1:
            # the torn last record of a run killed while writing, which a later segment (a resumed
            # run, which re-logs from its checkpoint and purges what came after it) continues
            print(
                f"nemo-fp8-compare: note: run {name or path.name}: {problem} (an earlier segment, continued by "
                f"{files[-1].name}: nothing of the curve is lost)",
                file=sys.stderr,
            )
            continue
        if problem:
            problems.append(problem)
    acc = _accumulator(path)
    tags = sorted(acc.Tags().get("scalars", []))
    name = name or path.name
    if tag is None:
        tag = next((t for t in LOSS_TAGS if t in tags), DEFAULT_TAG)
    if tag not in tags:
        hint = difflib.get_close_matches(tag, tags, n=1)
        raise CompareError(
            f"tag {tag!r} not found in run {name} ({path})."
            + (f" Did you mean {hint[0]!r}?" if hint else "")
            + f" Available scalar tags: {', '.join(tags) if tags else '(none)'}"
        )
    by_step: Dict[int, float] = {}
    for e in acc.Scalars(tag):  # wall-time order; a later write of the same step wins
        by_step[int(e.step)] = float(e.value)
    steps = sorted(by_step)
    tps = [float(e.value) for e in acc.Scalars(tokens_tag)] if tokens_tag in tags else []
    seed, deterministic, variant, setting, problem = read_run_config(path)
    if problem:
        print(f"nemo-fp8-compare: warning: {problem}", file=sys.stderr)
    data_sha256 = None
    try:  # written when the run finishes; runs of other trainers and older runs have none
        digest = json.loads((path / "summary.json").read_text(encoding="utf-8")).get("data_sha256")
        data_sha256 = digest if isinstance(digest, str) else None
    except (OSError, ValueError, AttributeError):
        pass
    return RunSeries(
        name=name,
        path=str(path),
        tag=tag,
        steps=steps,
        values=[by_step[s] for s in steps],
        tokens_per_s=tps,
        tags=tags,
        problems=problems,
        seed=seed,
        deterministic=deterministic,
        variant=variant,
        setting=setting,
        data_sha256=data_sha256,
    )


def run_names(paths: Sequence[Path]) -> List[str]:
    """Unique names for run directories: their own names, with the parent added where two share one."""
    names = [p.name for p in paths]
    if len(set(names)) == len(names):
        return names
    names = [f"{p.parent.name}/{p.name}" for p in paths]
    if len(set(names)) == len(names):
        return names
    return [str(p) for p in paths]


def up_to_step(run: RunSeries, step: int) -> RunSeries:
    """``run`` with its curve cut after ``step`` (``--until``); a run with no point up to it keeps
    none, and the comparison says so."""
    import dataclasses

    keep = [i for i, s in enumerate(run.steps) if s <= step]
    return dataclasses.replace(run, steps=[run.steps[i] for i in keep], values=[run.values[i] for i in keep])


def load_runs(paths: Sequence[str], tag: Optional[str] = None, tokens_tag: str = TOKENS_TAG) -> List[RunSeries]:
    """:func:`resolve_run_dirs` + :func:`load_run` for each, with unique names."""
    dirs = resolve_run_dirs(paths)
    return [load_run(d, tag, tokens_tag, name=n) for d, n in zip(dirs, run_names(dirs))]
